"""The megatron_lm feature's pieces, without a Megatron-LM checkout (CI has none).

The end-to-end proof with Megatron-LM's own pretrain_gpt.py is tests/e2e/test_megatron_lm.py
(runs where NPUSPEED_MEGATRON_LM points at a checkout).
"""
from __future__ import annotations

import argparse
import importlib
import json
import os
import pathlib
import shutil
import subprocess
import sys
import sysconfig
import textwrap
import types

import pytest

from npuspeed.patching.versions import in_range
import torch

from npuspeed.features.device import distopt_fixes as optimizer_fixes
from npuspeed.features.megatron_lm import build_helpers, load_stubs, validate
from npuspeed.features.cuda_mapping.redirect import cuda_calls_on_device, tensor_cuda_on

CPU = torch.device("cpu")
HERE = pathlib.Path(__file__).resolve().parent


# -- load-time stand-ins ------------------------------------------------------------------
@pytest.fixture
def no_batch_invariant_module(monkeypatch):
    monkeypatch.delitem(sys.modules, load_stubs.BATCH_INVARIANT, raising=False)
    yield
    load_stubs.uninstall()


def test_batch_invariant_stand_in_without_triton(no_batch_invariant_module, monkeypatch):
    monkeypatch.setattr(load_stubs, "_absent", lambda name: True)
    assert load_stubs.install() == [load_stubs.BATCH_INVARIANT]
    # What megatron.training.initialize and megatron.rl import from it.
    from megatron.core.transformer.custom_layers.batch_invariant_kernels import (
        enable_batch_invariant_mode, is_batch_invariant_mode_enabled, set_batch_invariant_mode)

    assert is_batch_invariant_mode_enabled() is False
    with pytest.raises(load_stubs.BatchInvariantUnavailable, match="--batch-invariant-mode.*triton"):
        enable_batch_invariant_mode()
    with set_batch_invariant_mode(False):
        pass
    with pytest.raises(load_stubs.BatchInvariantUnavailable):
        with set_batch_invariant_mode(True):
            pass
    load_stubs.uninstall()
    assert load_stubs.BATCH_INVARIANT not in sys.modules


def test_no_stand_in_where_triton_is_installed(no_batch_invariant_module, monkeypatch):
    monkeypatch.setattr(load_stubs, "_absent", lambda name: False)
    assert load_stubs.install() == []
    assert load_stubs.BATCH_INVARIANT not in sys.modules


# -- validate_args defaults -----------------------------------------------------------------
def megatron_lm_args(**overrides):
    """The fields portable_defaults reads, at Megatron-LM 0.16's defaults."""
    values = dict(transformer_impl="transformer_engine", gradient_accumulation_fusion=True,
                  no_persist_layer_norm=False, apply_rope_fusion=True, position_embedding_type="learned_absolute",
                  use_rotary_position_embeddings=False, tensor_model_parallel_size=1, context_parallel_size=1,
                  use_torch_fsdp2=False, use_megatron_fsdp=False, overlap_moe_expert_parallel_comm=False,
                  masked_softmax_fusion=True, bf16=False, fp16=False)
    values.update(overrides)
    return argparse.Namespace(**values)


def test_portable_defaults_where_te_and_apex_are_absent(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    args = megatron_lm_args(position_embedding_type="rope", tensor_model_parallel_size=2, bf16=True)
    notes = validate.portable_defaults(args, "cpu")
    assert args.transformer_impl == "local" and args.gradient_accumulation_fusion is False
    assert args.no_persist_layer_norm is True and args.apply_rope_fusion is False
    assert args.masked_softmax_fusion is False
    assert os.environ["CUDA_DEVICE_MAX_CONNECTIONS"] == "1"
    joined = "\n".join(notes)
    for flag in ("--transformer-impl local", "--no-gradient-accumulation-fusion", "--no-persist-layer-norm",
                 "--no-rope-fusion", "--no-masked-softmax-fusion", "CUDA_DEVICE_MAX_CONNECTIONS=1"):
        assert flag in joined


def test_portable_defaults_keep_what_the_machine_has(monkeypatch):
    monkeypatch.setattr(validate, "have_transformer_engine", lambda: True)
    monkeypatch.setattr(validate, "have_persist_layer_norm", lambda: True)
    monkeypatch.setattr(validate, "have_fused_rope", lambda: True)
    monkeypatch.setattr(validate, "have_fused_softmax", lambda: True)
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    args = megatron_lm_args(tensor_model_parallel_size=2, bf16=True)
    assert validate.portable_defaults(args, "cuda") == []
    assert args.transformer_impl == "transformer_engine" and args.gradient_accumulation_fusion
    assert not args.no_persist_layer_norm and args.apply_rope_fusion and args.masked_softmax_fusion
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # a GPU user sets it, as upstream asks


def test_connections_left_alone_for_fsdp_and_tp1(monkeypatch):
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)
    validate.portable_defaults(megatron_lm_args(tensor_model_parallel_size=2, use_torch_fsdp2=True), "cpu")
    validate.portable_defaults(megatron_lm_args(), "cpu")
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in os.environ  # FSDP asserts it is NOT 1


def test_rope_and_softmax_fusion_off_silently_where_unused(monkeypatch):
    args = megatron_lm_args(gradient_accumulation_fusion=False, no_persist_layer_norm=True,
                            transformer_impl="local")  # no rope, fp32
    assert validate.portable_defaults(args, "cpu") == []
    assert args.apply_rope_fusion is False and args.masked_softmax_fusion is False


def test_validate_args_wrapper_applies_defaults_first():
    seen = {}

    def validate_args(args, defaults={}):
        seen["impl"], seen["defaults"] = args.transformer_impl, defaults
        return "validated"

    wrapped = validate.validate_args_wrapper("cpu")(validate_args)
    assert wrapped(megatron_lm_args(), {"x": 1}) == "validated"
    assert seen == {"impl": "local", "defaults": {"x": 1}}
    assert validate.device_arch_version() == 0


# -- Tensor.cuda() mapped for a call --------------------------------------------------------
def test_tensor_cuda_is_mapped_inside_the_scope_only():
    original = torch.Tensor.cuda
    with tensor_cuda_on(CPU):
        moved = torch.ones(3).cuda(non_blocking=True)
        module = torch.nn.Linear(2, 2).cuda(CPU)  # nn.Module.cuda goes through Tensor.cuda
        with tensor_cuda_on(CPU):  # re-entrant
            assert torch.zeros(1).cuda().device == CPU
        assert torch.Tensor.cuda is not original
    assert moved.device == CPU and module.weight.device == CPU
    assert torch.Tensor.cuda is original
    with pytest.raises(ZeroDivisionError):
        with tensor_cuda_on(CPU):
            1 / 0
    assert torch.Tensor.cuda is original


def test_cuda_calls_on_device_wrapper():
    def get_batch(data):
        return {k: v.cuda(non_blocking=True) for k, v in data.items()}

    batch = cuda_calls_on_device(lambda: CPU)(get_batch)({"tokens": torch.arange(4)})
    assert batch["tokens"].device == CPU and get_batch.__name__ == "get_batch"


# -- the dataset helper build -----------------------------------------------------------------
MAKEFILE = textwrap.dedent("""\
    CXXFLAGS += -O0 -Wall -shared -std=c++17 -fPIC
    CPPFLAGS += $(shell python3 -m pybind11 --includes)
    LIBNAME = helpers_cpp
    LIBEXT = $(shell python3-config --extension-suffix)
    OUT = $(LIBNAME)$(LIBEXT)
    SRC = helpers.cpp
    default: $(OUT)
    $(OUT): $(SRC)
    \t$(CXX) $(CXXFLAGS) $(CPPFLAGS) $< -o $@
    """)  # the shape of megatron/core/datasets/Makefile (0.16)
HELPERS = textwrap.dedent("""\
    #include <pybind11/pybind11.h>
    int answer() { return 42; }
    PYBIND11_MODULE(helpers_cpp, m) { m.def("answer", &answer); }
    """)


def test_make_command_names_this_interpreter():
    pybind11 = pytest.importorskip("pybind11")
    command = build_helpers.make_command("/x")
    assert command[:3] == ["make", "-C", "/x"]
    assert f"-I{pybind11.get_include()}" in command[3] and sysconfig.get_paths()["include"] in command[3]
    assert command[4] == f"LIBEXT={sysconfig.get_config_var('EXT_SUFFIX')}"


def test_make_command_without_pybind11_says_how_to_get_it(monkeypatch):
    monkeypatch.setitem(sys.modules, "pybind11", None)
    with pytest.raises(build_helpers.HelperBuildError, match="pip install pybind11"):
        build_helpers.make_command("/x")


@pytest.mark.skipif(shutil.which("make") is None or shutil.which("c++") is None, reason="needs make and c++")
def test_helper_builds_for_this_python_whatever_python3_on_path_is(tmp_path, monkeypatch):
    pytest.importorskip("pybind11")
    (tmp_path / "Makefile").write_text(MAKEFILE)
    (tmp_path / "helpers.cpp").write_text(HELPERS)
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for name in ("python3", "python3-config"):  # a pyenv shim picking another Python, say
        (fake_bin / name).write_text("#!/bin/sh\necho wrong-python >&2\nexit 1\n")
        (fake_bin / name).chmod(0o755)
    monkeypatch.setenv("PATH", f"{fake_bin}{os.pathsep}{os.environ['PATH']}")
    build_helpers.build_in(str(tmp_path))
    built = tmp_path / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}"
    assert built.is_file()
    spec = importlib.util.spec_from_file_location("helpers_cpp", built)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert module.answer() == 42


def test_installed_wheel_without_makefile_uses_its_prebuilt_helper(tmp_path, monkeypatch):
    """megatron-core wheels ship helpers_cpp built and no Makefile (upstream's `make` fails
    there): the prebuilt module for this Python is used; without it, one error and exit 1."""
    ran = []
    monkeypatch.setattr(build_helpers.subprocess, "run", lambda *a, **k: ran.append(a))
    with pytest.raises(SystemExit):
        build_helpers.build_in(str(tmp_path))
    (tmp_path / f"helpers_cpp{sysconfig.get_config_var('EXT_SUFFIX')}").write_bytes(b"")
    build_helpers.build_in(str(tmp_path))
    assert ran == []  # make never ran


# -- DistributedOptimizer fixes ---------------------------------------------------------------
def _adam(n=3):
    params = [torch.nn.Parameter(torch.ones(2)) for _ in range(n)]
    return params, torch.optim.Adam(params, lr=0.1)


def test_lent_step_count_before_the_first_step():
    params, opt = _adam()
    with optimizer_fixes.lent_step_count(opt):
        assert {s["step"].item() for s in opt.state.values()} == {0.0}
    assert len(opt.state) == 0  # nothing left behind: Adam initialises its state as before
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    assert {s["step"].item() for s in opt.state.values()} == {1.0}


def test_lent_step_count_with_moments_but_no_step_and_with_steps():
    params, opt = _adam()
    opt.state[params[1]]["exp_avg"] = torch.zeros(2)  # what init_state_fn leaves
    with optimizer_fixes.lent_step_count(opt):
        assert all("step" in s for s in opt.state.values())
    assert dict(opt.state[params[1]]).keys() == {"exp_avg"} and params[0] not in opt.state
    opt.state[params[1]]["step"] = torch.tensor(5.0)
    with optimizer_fixes.lent_step_count(opt):
        assert params[0] not in opt.state  # a step exists: nothing lent
    assert opt.state[params[1]]["step"].item() == 5.0


def test_shared_step_tensor_miscounts_and_own_step_counts_fixes_it():
    params, opt = _adam()
    for p in params:
        p.grad = torch.ones(2)
    opt.step()
    shared = torch.tensor(1.0)
    for p in params:
        opt.state[p]["step"] = shared  # what upstream's load_state_dict leaves
    assert optimizer_fixes.own_step_counts(opt) == 2
    opt.step()
    assert [opt.state[p]["step"].item() for p in params] == [2.0, 2.0, 2.0]
    # Upstream's state: each step adds one per parameter.
    for p in params:
        opt.state[p]["step"] = shared
    before = shared.item()
    opt.step()
    assert shared.item() == before + len(params)


def test_keep_step_count_replaces_only_the_step():
    params, opt = _adam(1)
    opt.state[params[0]].update(step=torch.tensor(7.0), exp_avg=torch.zeros(2))
    fake = types.SimpleNamespace(
        optimizer=opt, model_param_group_index_map={"w": (0, 0)},
        config=types.SimpleNamespace(use_precision_aware_optimizer_no_fp8_or_ds_fp8=False))
    got = {}
    wrapped = optimizer_fixes.keep_step_count(lambda self, mp, tensors: got.update(tensors))
    import megatron.core.optimizer.distrib_optimizer as distrib

    if distrib.HAVE_APEX_OR_TE:
        pytest.skip("apex/TE present: Adam keeps no per-parameter step")
    wrapped(fake, "w", {"step": torch.tensor(0.0), "exp_avg": torch.ones(2)})
    assert got["step"].item() == 7.0 and torch.equal(got["exp_avg"], torch.ones(2))
    got.clear()  # fully_reshardable's load passes no step at all (3c): the current one is supplied
    wrapped(fake, "w", {"exp_avg": torch.ones(2)})
    assert got["step"].item() == 7.0 and torch.equal(got["exp_avg"], torch.ones(2))


def test_under_no_grad():
    leaf = torch.zeros(4, requires_grad=True)

    def copy_into_view(values):
        leaf.view(-1)[:2].copy_(values)

    with pytest.raises(RuntimeError):
        copy_into_view(torch.ones(2))
    optimizer_fixes.under_no_grad(copy_into_view)(torch.ones(2))
    assert leaf.tolist() == [1.0, 1.0, 0.0, 0.0]


def _resume(which: str) -> dict:
    proc = subprocess.run([sys.executable, str(HERE / "_distopt_resume_scenario.py"), which],
                          capture_output=True, text=True, timeout=600, cwd=HERE)
    line = next((l for l in proc.stdout.splitlines() if l.startswith("RESULT ")), None)
    return {"rc": proc.returncode, "out": proc.stdout + proc.stderr,
            **(json.loads(line[len("RESULT "):]) if line else {})}


@pytest.mark.skipif(not in_range(">=0.16"), reason="the dp_reshardable path and its fixes are megatron-core 0.16's")
# `make bench` (-m slow): a distributed-optimizer checkpoint is resumed in CI by the example
# (test_checkpoint_layouts, dp2distopt-reuse-to-dp1-bf16)
@pytest.mark.slow
def test_distributed_optimizer_resume_through_dist_checkpointing():
    """Real DistributedOptimizer, torch Adam: unpatched the load template asserts; with the
    template and no_grad fixes only, the step count is wrong after the load (0, shared) and
    training diverges; with all fixes the resumed losses equal the uninterrupted run bitwise."""
    none = _resume("none")
    assert none["rc"] != 0 and "distrib_optimizer.py" in none["out"] and "AssertionError" in none["out"]
    partial = _resume("no-step")
    assert partial["rc"] == 0, partial["out"][-3000:]
    assert set(partial["steps_after_load"]) == {0.0} and partial["distinct_step_tensors"] == 1
    assert partial["resumed"][1:] != partial["reference"][1:]
    fixed = _resume("all")
    assert fixed["rc"] == 0, fixed["out"][-3000:]
    assert set(fixed["steps_after_load"]) == {2.0} and fixed["distinct_step_tensors"] == fixed["params"]
    assert fixed["resumed"] == fixed["reference"]


# -- what the feature registers, per backend ----------------------------------------------------
class RecordingRegistry:
    def __init__(self):
        self.calls = []

    def register(self, target, replacement=None, *, wrapper=None, feature, megatron=">=0.12", **kw):
        self.calls.append((target, "wrap" if wrapper else "replace", megatron))

    def patches(self, feature=None):
        return []


def _registered(accelerator_name: str) -> dict:
    from npuspeed.features.megatron_lm import MegatronLMFeature

    registry = RecordingRegistry()
    from feature_ctx import ctx_for

    acc = types.SimpleNamespace(name=accelerator_name, device=lambda index=None: CPU)
    MegatronLMFeature().register_patches(registry, ctx_for([], acc))
    return {target: (kind, rng) for target, kind, rng in registry.calls}


def test_registered_patches_per_backend():
    from npuspeed.features.megatron_lm import MEGATRON_LM_RANGE, targets

    cpu, npu, cuda = _registered("cpu"), _registered("npu"), _registered("cuda")
    common = {"megatron.training.arguments.parse_args", "megatron.training.arguments.validate_args",
              "megatron.core.datasets.utils.compile_helpers"}
    assert common <= set(cuda) and common <= set(npu) and common <= set(cpu)
    off_cuda = {"megatron.training.utils.get_device_arch_version", "megatron.legacy.fused_kernels.load",
                "megatron.training.utils.common_utils.get_device_arch_version"}
    assert not off_cuda & set(cuda) and off_cuda <= set(npu) and off_cuda <= set(cpu)
    cpu_only = {"megatron.training.training.torch", "megatron.training.utils.get_batch_on_this_tp_rank",
                "megatron.training.training.get_model", "megatron.training.utils.common_utils.torch",
                "megatron.training.training.pretrain"}
    assert cpu_only <= set(cpu) and not cpu_only & set(npu)
    # The distributed-optimizer fixes and the get_device_properties answer belong to the device
    # feature (megatron.core alone meets them), so this feature must not register them twice.
    device_owned = {"torch.cuda.get_device_properties",
                    "megatron.core.optimizer.distrib_optimizer.DistributedOptimizer.state_dict"}
    assert not device_owned & (set(cpu) | set(npu) | set(cuda))
    # Megatron-LM's targets are versioned by the range each was checked against, where upstream
    # put it: the moved ones (utils.py -> utils/common_utils.py at 0.18) per range.
    assert all(rng is not None for t, (kind, rng) in cpu.items() if t.startswith("megatron.")
               and not t.endswith("parse_args"))
    assert cpu["megatron.training.utils.get_device_arch_version"][1] == targets.R16_17
    assert cpu["megatron.training.utils.common_utils.get_device_arch_version"][1] == targets.R18_19
    assert cpu["megatron.legacy.fused_kernels.load"][1] == ">=0.16,<0.17"
    assert cpu["megatron.training.training.pretrain"] == ("wrap", targets.R18_19)
    assert cpu["megatron.training.utils.get_batch_on_this_tp_rank"][1] == targets.R16_17
    assert MEGATRON_LM_RANGE == ">=0.16,<0.20"


def _tag_sources(tag: str):
    """A reader of Megatron-LM's files at `tag` (path -> text, None where absent), from the
    checkout NPUSPEED_MEGATRON_LM names, as tests/e2e/test_megatron_lm.py finds it: a git clone
    (bare or not) answers for every tag; a plain checkout only for the tag of its version."""
    from npuspeed.features.megatron_lm.source_patch import KNOWN_VERSIONS, PatchSourceError, read_version

    checkout = os.environ.get("NPUSPEED_MEGATRON_LM", "")
    if not checkout:
        pytest.skip(f"set NPUSPEED_MEGATRON_LM to a Megatron-LM git clone (or a checkout at {tag})")
    root = pathlib.Path(checkout)
    has_tag = subprocess.run(["git", "-C", str(root), "rev-parse", "--verify", "--quiet", f"{tag}^{{commit}}"],
                             capture_output=True, text=True).returncode == 0
    if has_tag:
        def read(path: str):
            shown = subprocess.run(["git", "-C", str(root), "show", f"{tag}:{path}"], capture_output=True, text=True)
            return shown.stdout if shown.returncode == 0 else None
        return read
    try:
        version = read_version(root)
    except PatchSourceError:
        version = None
    if KNOWN_VERSIONS.get(version) != tag:
        pytest.skip(f"NPUSPEED_MEGATRON_LM={root} is neither a git clone with tag {tag} nor a checkout at it")
    return lambda path: (root / path).read_text() if (root / path).is_file() else None


@pytest.mark.parametrize("version,present", [
    ("0.16.1", {"utils.torch", "utils.get_batch_on_this_tp_rank", "training.get_model"}),
    ("0.17.1", {"utils.torch", "utils.get_batch_on_this_tp_rank", "training.get_model"}),
    ("0.19.2", {"utils.common_utils.torch", "utils.common_utils.get_device_arch_version",
                "training.pretrain"}),
])
def test_every_target_resolves_on_its_release(version, present):
    """Each Megatron-LM target registered for a release names something in that release's source
    (read from the tag's files, not imported): the per-range table follows upstream's moves."""
    from packaging.version import Version

    from npuspeed.features.megatron_lm import targets
    from npuspeed.patching.versions import in_range

    tag = {"0.16.1": "core_v0.16.1", "0.17.1": "core_v0.17.0", "0.19.2": "core_v0.19.0"}[version]
    read = _tag_sources(tag)
    tables = (targets.DEVICE_ARCH, {f"{m}.torch": r for m, r in targets.TORCH_MODULES.items()},
              targets.CUDA_CALLS)
    wanted = {t for table in tables for t, rng in table.items() if in_range(rng, Version(version))}
    assert present <= wanted
    for target in wanted:
        module, name = target.rsplit(".", 1)
        text = read("megatron/training/" + module.replace(".", "/") + ".py")
        assert text is not None, (version, target)
        assert (f"def {name}(" in text) if name != "torch" else ("\nimport torch\n" in text), (version, target)


def test_the_cuda_names_megatron_training_calls_are_shimmed_on_cpu():
    from npuspeed.features.device.cuda_shim import shim_names
    from npuspeed.features.megatron_lm.device_fixes import shim_names_needed

    assert set(shim_names_needed()) <= set(shim_names())


COMPILE = """
import sys, torch
from npuspeed.features.device import cuda_shim
if sys.argv[1] == "plain":  # the shim without its get_device_properties answer
    del cuda_shim._SHIMS["get_device_properties"]
import npuspeed.megatron_adaptor
fused = torch.compile(lambda x, b: torch.nn.functional.gelu(x + b))  # a Megatron jit_fuser shape
print("RESULT", float(fused(torch.ones(4), torch.ones(4)).sum()))
"""


@pytest.mark.parametrize("mode", ["plain", "fixed"])
def test_torch_compile_under_the_cuda_shim(mode, tmp_path):
    """megatron.training compiles its jit_fuser functions at start-up. Inductor asks
    torch.cuda.is_available; the shim answers torch's own modules with torch's truth, so it
    compiles for the CPU even without the shim's get_device_properties answer (plain), and
    with it (fixed)."""
    if shutil.which("c++") is None and shutil.which("g++") is None:
        pytest.skip("inductor needs a C++ compiler")
    proc = subprocess.run([sys.executable, "-c", COMPILE, mode], capture_output=True, text=True,
                          timeout=600, cwd=tmp_path, env=dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path)))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "RESULT 7.8" in proc.stdout  # 4 * gelu(2) = 7.818...


def test_missing_load_time_imports_name_the_extra(monkeypatch):
    from feature_ctx import ctx_for

    from npuspeed.features import megatron_lm
    from npuspeed.features.base import FeatureError

    from npuspeed.patching import versions
    from packaging.version import Version

    monkeypatch.setattr(versions, "megatron_version", lambda: Version("0.16.1"))
    monkeypatch.setattr(megatron_lm.megatron_lm_feature, "_importable", lambda module: module != "pydantic")
    with pytest.raises(FeatureError, match=r"imports pydantic at load.*npuspeed\[megatron-lm\]"):
        megatron_lm.MegatronLMFeature().validate(ctx_for([], None))
    monkeypatch.setattr(megatron_lm.megatron_lm_feature, "_importable", lambda module: True)
    megatron_lm.MegatronLMFeature().validate(ctx_for([], None))
    assert {pip for pip, _ in megatron_lm.LOAD_TIME_IMPORTS.values()} <= set(_extra("megatron-lm"))


@pytest.mark.parametrize("release,needed", [("0.16.1", {"regex", "pydantic", "six", "pyyaml"}),
                                            ("0.17.0", {"pyyaml"}), ("0.18.2", {"pyyaml"}),
                                            ("0.19.2", set())])
def test_load_time_imports_follow_the_release(monkeypatch, release, needed):
    """megatron-core 0.19's wheel ships megatron/training with no third-party import at load:
    asking a fresh 0.19 install for regex/pydantic/six stopped every run (CI, stop 38)."""
    from feature_ctx import ctx_for
    from packaging.version import Version

    from npuspeed.features import megatron_lm
    from npuspeed.features.base import FeatureError
    from npuspeed.patching import versions

    monkeypatch.setattr(versions, "megatron_version", lambda: Version(release))
    monkeypatch.setattr(megatron_lm.megatron_lm_feature, "_importable", lambda module: False)
    if not needed:
        megatron_lm.MegatronLMFeature().validate(ctx_for([], None))
        return
    with pytest.raises(FeatureError) as err:
        megatron_lm.MegatronLMFeature().validate(ctx_for([], None))
    named = set(str(err.value).split(" imports ")[1].split(" at load")[0].split(", "))
    assert named == needed


def _extra(name: str) -> list[str]:
    import ast

    tree = ast.parse((HERE.parents[1] / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and getattr(node.targets[0], "id", None) == "EXTRAS":
            return ast.literal_eval(node.value)[name]
    raise AssertionError("EXTRAS not found in setup.py")
