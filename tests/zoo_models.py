"""A zoo of small architectures built from Hugging Face configs (no downloads, random weights).

Each entry builds `(model, batch)` deterministically under a fixed seed: a batch of 4 rows so
that data parallelism over 2 replicas gets 2 rows each, widths that 2 divides (heads, channels,
experts). `FAMILY` groups them as the issue's checks do: decoder LMs must have their matmul FLOPs
split by `tp`, the others only need to train exactly.
"""
from __future__ import annotations

from typing import Callable

import torch

VOCAB, BATCH, SEQ = 128, 4, 16


def _ids(vocab: int = VOCAB, batch: int = BATCH, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(1, vocab, (batch, seq))


def _lm(model_cls: str, config_cls: str, **cfg) -> Callable[[], tuple[torch.nn.Module, dict]]:
    """A causal or masked LM: input ids, labels equal to the ids (the model shifts them if causal)."""

    def build():
        import transformers

        config = getattr(transformers, config_cls)(**cfg)
        model = getattr(transformers, model_cls)(config)
        ids = _ids(cfg.get("vocab_size", VOCAB))
        return model, {"input_ids": ids, "labels": ids.clone()}

    return build


_DEC = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
            max_position_embeddings=64, use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)


def _dec(**over):
    return {**_DEC, **over}


def _seq2seq(model_cls: str, config_cls: str, **cfg):
    def build():
        import transformers

        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**cfg))
        return model, {"input_ids": _ids(), "labels": _ids(seq=8)}

    return build


def _wav2vec2():
    from transformers import Wav2Vec2Config, Wav2Vec2ForCTC

    cfg = Wav2Vec2Config(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                         intermediate_size=64, conv_dim=(16, 16), conv_stride=(5, 2), conv_kernel=(10, 3),
                         num_conv_pos_embeddings=16, num_conv_pos_embedding_groups=4, do_stable_layer_norm=True,
                         feat_extract_norm="layer", mask_time_prob=0.0, ctc_loss_reduction="mean",
                         pad_token_id=0)
    model = Wav2Vec2ForCTC(cfg)
    return model, {"input_values": torch.randn(BATCH, 400), "labels": torch.randint(1, 32, (BATCH, 6))}


def _whisper():
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    cfg = WhisperConfig(vocab_size=VOCAB, num_mel_bins=16, d_model=32, encoder_layers=2, decoder_layers=2,
                        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
                        decoder_ffn_dim=64, max_source_positions=16, max_target_positions=32, use_cache=False,
                        pad_token_id=0, bos_token_id=1, eos_token_id=2, decoder_start_token_id=1)
    model = WhisperForConditionalGeneration(cfg)
    return model, {"input_features": torch.randn(BATCH, 16, 32), "labels": _ids(seq=8)}


def _image(model_cls: str, config_cls: str, size: int = 32, classes: int = 10, **cfg):
    def build():
        import transformers

        model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(num_labels=classes, **cfg))
        return model, {"pixel_values": torch.randn(BATCH, 3, size, size),
                       "labels": torch.randint(0, classes, (BATCH,))}

    return build


ZOO: dict[str, Callable[[], tuple[torch.nn.Module, dict]]] = {
    # dense decoders
    "llama": _lm("LlamaForCausalLM", "LlamaConfig", **_dec(num_key_value_heads=2)),
    "mistral": _lm("MistralForCausalLM", "MistralConfig", **_dec(num_key_value_heads=2, sliding_window=8)),
    "qwen2": _lm("Qwen2ForCausalLM", "Qwen2Config", **_dec(num_key_value_heads=2)),
    "gemma2": _lm("Gemma2ForCausalLM", "Gemma2Config", **_dec(num_key_value_heads=2, head_dim=16,
                                                                 attn_logit_softcapping=50.0,
                                                                 final_logit_softcapping=30.0, sliding_window=8)),
    "phi3": _lm("Phi3ForCausalLM", "Phi3Config", **_dec(num_key_value_heads=2)),
    "stablelm": _lm("StableLmForCausalLM", "StableLmConfig", **_dec(num_key_value_heads=4)),
    "gpt2": _lm("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64,
                use_cache=False, bos_token_id=1, eos_token_id=2),
    "gpt_neox": _lm("GPTNeoXForCausalLM", "GPTNeoXConfig", **_dec()),
    "gptj": _lm("GPTJForCausalLM", "GPTJConfig", vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=8,
                n_positions=64, use_cache=False, bos_token_id=1, eos_token_id=2),
    "falcon": _lm("FalconForCausalLM", "FalconConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
                  num_attention_heads=4, multi_query=True, new_decoder_architecture=False, parallel_attn=True,
                  bias=False, use_cache=False, bos_token_id=1, eos_token_id=2),
    "bloom": _lm("BloomForCausalLM", "BloomConfig", vocab_size=VOCAB, hidden_size=64, n_layer=2, n_head=4,
                 use_cache=False, bos_token_id=1, eos_token_id=2),
    "gpt_bigcode": _lm("GPTBigCodeForCausalLM", "GPTBigCodeConfig", vocab_size=VOCAB, n_embd=64, n_layer=2,
                       n_head=4, n_positions=64, multi_query=True, use_cache=False, bos_token_id=1, eos_token_id=2),
    "opt": _lm("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, ffn_dim=128, max_position_embeddings=64, word_embed_proj_dim=64,
               use_cache=False, bos_token_id=1, eos_token_id=2, pad_token_id=0),
    # mixture-of-experts decoders
    "mixtral": _lm("MixtralForCausalLM", "MixtralConfig", **_dec(num_key_value_heads=2, num_local_experts=4,
                                                                  num_experts_per_tok=2)),
    "qwen2_moe": _lm("Qwen2MoeForCausalLM", "Qwen2MoeConfig", **_dec(num_key_value_heads=2, num_experts=4,
                                                                      num_experts_per_tok=2,
                                                                      moe_intermediate_size=32,
                                                                      shared_expert_intermediate_size=64)),
    "qwen3_moe": _lm("Qwen3MoeForCausalLM", "Qwen3MoeConfig", **_dec(num_key_value_heads=2, head_dim=16,
                                                                      num_experts=4, num_experts_per_tok=2,
                                                                      moe_intermediate_size=32)),
    "deepseek_v3": _lm("DeepseekV3ForCausalLM", "DeepseekV3Config",
                       **_dec(num_key_value_heads=4, n_routed_experts=4, num_experts_per_tok=2, n_group=2,
                              topk_group=1, moe_intermediate_size=32, first_k_dense_replace=1, q_lora_rank=32,
                              kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16,
                              n_shared_experts=1, rope_interleave=True)),
    # encoder-decoders
    "t5": _seq2seq("T5ForConditionalGeneration", "T5Config", vocab_size=VOCAB, d_model=64, d_kv=16, d_ff=128,
                   num_layers=2, num_heads=4, decoder_start_token_id=0, pad_token_id=0, eos_token_id=1),
    "bart": _seq2seq("BartForConditionalGeneration", "BartConfig", vocab_size=VOCAB, d_model=64, encoder_layers=2,
                     decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                     decoder_ffn_dim=128, max_position_embeddings=64, use_cache=False, pad_token_id=0,
                     bos_token_id=1, eos_token_id=2, decoder_start_token_id=2, forced_eos_token_id=2),
    # masked LMs
    "bert": _lm("BertForMaskedLM", "BertConfig", **_dec(type_vocab_size=2)),
    "roberta": _lm("RobertaForMaskedLM", "RobertaConfig", **_dec(type_vocab_size=1)),
    "deberta_v2": _lm("DebertaV2ForMaskedLM", "DebertaV2Config", **_dec(type_vocab_size=0)),
    "electra": _lm("ElectraForMaskedLM", "ElectraConfig", **_dec(embedding_size=32, type_vocab_size=2)),
    # audio
    "wav2vec2": _wav2vec2,
    "whisper": _whisper,
    # vision
    "vit": _image("ViTForImageClassification", "ViTConfig", num_hidden_layers=2, hidden_size=64,
                  intermediate_size=128, num_attention_heads=4, image_size=32, patch_size=8),
    "convnext": _image("ConvNextForImageClassification", "ConvNextConfig", num_channels=3, hidden_sizes=[16, 32],
                       depths=[1, 1], num_stages=2, patch_size=4),
    "resnet": _image("ResNetForImageClassification", "ResNetConfig", num_channels=3, embedding_size=16,
                     hidden_sizes=[16, 32], depths=[1, 1], layer_type="basic"),
}

DECODER_LMS = ("llama", "mistral", "qwen2", "gemma2", "phi3", "stablelm", "gpt2", "gpt_neox", "gptj", "falcon",
               "bloom", "gpt_bigcode", "opt", "mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v3")

FAMILY = {**{n: "decoder" for n in DECODER_LMS[:13]}, **{n: "moe decoder" for n in DECODER_LMS[13:]},
          "t5": "encoder-decoder", "bart": "encoder-decoder", "bert": "masked LM", "roberta": "masked LM",
          "deberta_v2": "masked LM", "electra": "masked LM", "wav2vec2": "audio", "whisper": "audio",
          "vit": "vision", "convnext": "vision", "resnet": "vision"}


def build(name: str) -> tuple[torch.nn.Module, dict]:
    """The named model and its batch, under a fixed seed (the same weights every call)."""
    torch.manual_seed(0)
    return ZOO[name]()
