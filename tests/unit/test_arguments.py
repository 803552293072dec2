"""npuspeed's flags: parsed next to Megatron's, from argv and NPUSPEED_ARGS, with clear errors."""
from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from npuspeed import arguments
from npuspeed.features import all_features

FEATURES = all_features()


def _parse(argv):
    return arguments.parse_args(FEATURES, arguments.argv_with_env(argv))


def test_megatron_flags_are_left_alone(monkeypatch):
    monkeypatch.delenv("NPUSPEED_ARGS", raising=False)
    argv = ["--tensor-model-parallel-size", "2", "--npuspeed-device", "cpu", "--seq-length", "8", "--bf16"]
    args, unknown = arguments.build_parser(FEATURES).parse_known_args(argv)
    assert args.npuspeed_device == "cpu"
    assert unknown == ["--tensor-model-parallel-size", "2", "--seq-length", "8", "--bf16"]
    assert _parse(argv).npuspeed_device == "cpu"
    assert _parse([]).npuspeed_device == "auto"


def test_npuspeed_args_env_is_merged(monkeypatch):
    monkeypatch.setenv("NPUSPEED_ARGS", "--npuspeed-device 'cpu'")
    assert arguments.argv_with_env(["--seq-length", "8"]) == ["--seq-length", "8", "--npuspeed-device", "cpu"]
    assert _parse(["--seq-length", "8"]).npuspeed_device == "cpu"


def test_argv_defaults_to_sys_argv(monkeypatch):
    monkeypatch.delenv("NPUSPEED_ARGS", raising=False)
    monkeypatch.setattr(sys, "argv", ["train.py", "--npuspeed-device", "cpu", "--lr", "1"])
    assert _parse(None).npuspeed_device == "cpu"


def test_bad_choice_names_flag_and_choices(monkeypatch):
    from npuspeed.errors import UserError

    monkeypatch.delenv("NPUSPEED_ARGS", raising=False)
    with pytest.raises(UserError) as exc:  # the adaptor turns it into one line and exit status 2
        _parse(["--npuspeed-device", "tpu"])
    err = str(exc.value)
    assert "--npuspeed-device" in err and "tpu" in err
    for choice in ("auto", "npu", "cuda", "cpu"):
        assert choice in err


def test_env_typo_is_refused_other_words_pass(monkeypatch):
    from npuspeed.errors import UserError

    monkeypatch.setenv("NPUSPEED_ARGS", "--bf16 --tensor-model-parallel-size 2 --use-cocc")
    with pytest.raises(UserError, match="did you mean --use-coc"):
        _parse([])
    monkeypatch.setenv("NPUSPEED_ARGS", "--bf16 --tensor-model-parallel-size 2 --use-coc")
    assert _parse([]).use_coc


def test_add_arguments_skips_existing_option():
    parser = argparse.ArgumentParser()
    parser.add_argument("--npuspeed-device", default="theirs")
    arguments.add_arguments(parser, FEATURES)  # no argparse.ArgumentError for the conflict
    assert parser.parse_args([]).npuspeed_device == "theirs"
    assert parser.parse_args(["--npuspeed-device", "anything"]).npuspeed_device == "anything"
    group = [g for g in parser._action_groups if g.title == arguments.GROUP_TITLE]
    assert len(group) == 1


def test_add_arguments_to_fresh_parser_adds_every_feature_flag():
    parser = arguments.add_arguments(argparse.ArgumentParser(), FEATURES)
    for feature in FEATURES:
        for flag in feature.flags:
            assert flag in parser._option_string_actions, flag


def test_megatron_lm_parse_args_wrapper_chains_providers():
    seen = []

    def their_provider(parser):
        seen.append("theirs")
        parser.add_argument("--their-flag", type=int, default=0)
        return parser

    def parse_args(extra_args_provider=None, ignore_unknown_args=False):
        parser = argparse.ArgumentParser()
        parser.add_argument("--seq-length", type=int)
        parser = extra_args_provider(parser)
        return parser.parse_args(["--seq-length", "4", "--their-flag", "3", "--npuspeed-device", "cpu"])

    from npuspeed.features.megatron_lm.parser import parse_args_wrapper

    extend = lambda parser: arguments.add_arguments(parser, FEATURES)  # noqa: E731 (ctx.extend_parser)
    args = parse_args_wrapper(extend)(parse_args)(their_provider)
    assert seen == ["theirs"]
    assert (args.seq_length, args.their_flag, args.npuspeed_device) == (4, 3, "cpu")


def test_npuspeed_help_lists_features():
    code = "import sys; sys.argv=['x','--npuspeed-help']; import npuspeed.megatron_adaptor"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "npuspeed features" in proc.stdout
    assert "device" in proc.stdout and "always on" in proc.stdout
    assert "--npuspeed-device" in proc.stdout
    # help exits before anything is patched or megatron is imported
    assert "npuspeed: device=" not in proc.stderr
