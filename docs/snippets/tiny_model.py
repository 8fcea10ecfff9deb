import nnscaler_plugins as nns

torch.manual_seed(0)
model = TinyLM()
ids = torch.randint(0, 64, (8, 16))
batch = {"ids": ids, "labels": ids}  # what model(**batch) takes: 8 sequences of 16 tokens
graph = nns.capture(model, kwargs=batch)
