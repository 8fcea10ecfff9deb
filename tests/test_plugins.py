"""The plugin system: a third-party package, installed by pip with an entry point in the
`nnscaler_plugins` group, adds a strategy and an op rule that a fresh process uses by name; the
environment switches (disable autoload, block, trace) and a broken plugin's message.

The packages are installed with `pip --target` into a temporary directory put on PYTHONPATH of the
child processes, so the shared environment is never changed.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

PLUGIN = '''
"""A third-party nnscaler plugin: a strategy and the rule for its custom op."""
import torch
from nnscaler_plugins.hookspecs import hookimpl
from nnscaler_plugins.rules.elementwise import elementwise


@torch.library.custom_op("toyplug::twice", mutates_args=())
def twice(x: torch.Tensor) -> torch.Tensor:
    return x * 2


@twice.register_fake
def _(x):
    return torch.empty_like(x)


twice.register_autograd(lambda ctx, g: g * 2)


def replicate_all(builder, **options):
    for op in builder.ops:
        builder.replicate(op, devices=[0])


replicate_all.degrees = lambda world_size, **options: (1, world_size)


@hookimpl
def nnscaler_register_strategies():
    return {"toy_dp": replicate_all}


@hookimpl
def nnscaler_register_op_rules():
    return {"toyplug.twice.default": elementwise}
'''

USER = '''
import json, sys, torch
import nnscaler_plugins as nns
from nnscaler_plugins.plugins import plugin_names

try:
    import toyplug  # noqa: F401  (defines the custom op when the plugin package is there)
except ImportError:
    torch.library.custom_op("toyplug::twice", mutates_args=())(lambda x: x * 2)


class M(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x):
        return torch.ops.toyplug.twice(self.lin(x)).sum()


seen = {}


def split_batch(builder, **_):
    """Split every op along its output's first dim where the rules allow, else replicate."""
    for op in builder.ops:
        ok = op.splittable(0, builder.unit_size)
        if "twice" in op.name:
            seen["twice_splittable"] = ok
        if ok:
            builder.split(op, [(0, builder.unit_size)])
        else:
            builder.replicate(op)


x = torch.randn(4, 8)
nns.plan(M(), strategy=split_batch, world_size=2, example_inputs=x)
out = {"strategies": nns.strategies(), "plugins": plugin_names(), **seen}
if "toy_dp" in out["strategies"]:
    out["toy_dp"] = nns.plan(M(), strategy="toy_dp", world_size=2, example_inputs=x).dp
print("RESULT " + json.dumps(out))
'''


def _package(root, name: str, entry: str, module: str | None) -> str:
    d = root / name
    d.mkdir()
    (d / "pyproject.toml").write_text(textwrap.dedent(f'''
        [build-system]
        requires = ["setuptools>=61"]
        build-backend = "setuptools.build_meta"

        [project]
        name = "{name}"
        version = "0.1"

        [project.entry-points.nnscaler_plugins]
        {name} = "{entry}"

        [tool.setuptools]
        py-modules = [{'"' + name + '"' if module else ""}]
        '''))
    if module:
        (d / f"{name}.py").write_text(module)
    return str(d)


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugins")
    good = _package(root, "toyplug", "toyplug", PLUGIN)
    broken = _package(root, "toybroken", "toybroken_missing_module", None)
    sites = {}
    for name, src in (("good", good), ("broken", broken)):
        target = root / f"site-{name}"
        subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation",
                        "--target", str(target), src], check=True, capture_output=True, timeout=300)
        sites[name] = str(target)
    (root / "user.py").write_text(USER)
    return root, sites


def _run(installed, sites: list[str], **env) -> tuple[int, dict, str]:
    root, paths = installed
    full_env = {k: v for k, v in os.environ.items() if not k.startswith("NNSCALER_PLUGINS_")}
    full_env.update(env, PYTHONPATH=os.pathsep.join([paths[s] for s in sites] + [os.environ.get("PYTHONPATH", "")]),
                    PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, str(root / "user.py")], env=full_env, capture_output=True, text=True,
                          timeout=300, cwd=str(root))
    rows = [json.loads(line[7:]) for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    return proc.returncode, (rows[0] if rows else {}), proc.stderr


def test_third_party_strategy_and_op_rule_by_entry_point_with_tracing(installed):
    rc, out, err = _run(installed, ["good"], NNSCALER_PLUGINS_TRACE="1")
    assert rc == 0, err[-3000:]
    assert "toy_dp" in out["strategies"] and "tp" in out["strategies"]
    assert out["toy_dp"] == 2  # the plugin's strategy, used by name
    assert out["twice_splittable"] is True  # the plugin's rule for its custom op, used in a plan
    assert "toyplug" in out["plugins"] and "builtin_lightning" in out["plugins"]
    assert "nnscaler_register_op_rules [hook]" in err and "nnscaler_adapt_model_for_capture [hook]" in err  # traced


def test_broken_plugin_is_named_and_switches_skip_it(installed):
    rc, _, err = _run(installed, ["good", "broken"])
    assert rc != 0 and "plugin 'toybroken'" in err and "NNSCALER_PLUGINS_BLOCK=toybroken" in err, err[-3000:]

    rc, out, err = _run(installed, ["good", "broken"], NNSCALER_PLUGINS_BLOCK="toybroken, toyplug")
    assert rc == 0, err[-3000:]
    assert "toy_dp" not in out["strategies"] and out["twice_splittable"] is False  # without the rule: replicated
    assert "tp" in out["strategies"] and "toyplug" not in out["plugins"]

    rc, out, err = _run(installed, ["good", "broken"], NNSCALER_PLUGINS_DISABLE_AUTOLOAD="1")
    assert rc == 0, err[-3000:]
    assert "toy_dp" not in out["strategies"] and "toybroken" not in out["plugins"]
    assert {"builtin_strategies", "builtin_lightning", "builtin_hf"} <= set(out["plugins"])  # built-ins stay
    assert "tp" in out["strategies"] and "NNSCALER" not in err


def test_loading_plugins_imports_no_framework_and_not_the_deepspeed_drop_in():
    """Every process that makes a plugin manager registers the built-in adapters; their plugin
    modules are thin, so that costs neither transformers, Lightning, DeepSpeed nor the DeepSpeed
    drop-in's forty modules (about 2 MiB on each rank when the drop-in was the plugin). The drop-in's
    hook and built-in translation still answer once it is used."""
    code = (
        "import sys\n"
        "from nnscaler_plugins.plugins import get_plugin_manager\n"
        "pm = get_plugin_manager()\n"
        "loaded = [m for m in ('nnscaler_plugins.adapters.deepspeed', 'transformers', 'lightning', 'deepspeed')"
        " if m in sys.modules]\n"
        "assert not loaded, loaded\n"
        "assert pm.has_plugin('builtin_deepspeed') and pm.has_plugin('builtin_hf')\n"
        "from nnscaler_plugins.adapters import deepspeed\n"
        "s = deepspeed.settings_of({'train_micro_batch_size_per_gpu': 2, 'zero_optimization': {'stage': 3}})\n"
        "print(type(s).__name__, s.zero_stage)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["Settings", "3"], proc.stdout
