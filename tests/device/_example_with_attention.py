"""Run examples/pretrain_gpt.py unchanged, then write the latest fused-attention call's details
(kernel, mask, causal, dropout_p, dtype) to `--attention-json PATH.rank<N>`: the device tier's
proof that the call ran causal and with dropout on the device kernel (the summary has the counts).

NPUSPEED_TEST_WINDOW_SIZE=LEFT,RIGHT gives the model Megatron's own sliding window
(TransformerConfig.window_size, honoured by its unfused attention): the flag-off reference of
the --pre-tockens/--next-tockens band (the example has no flag for it)."""
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))

WINDOW = "NPUSPEED_TEST_WINDOW_SIZE"


def _collect() -> dict:
    from npuspeed import telemetry
    from npuspeed.features.fused_attention.forward import LAST

    plain = (bool, int, float, str, list, tuple, type(None))
    return {"last": {k: v if isinstance(v, plain) else str(v) for k, v in telemetry.last(LAST).items()}}


def _with_window(window: str) -> None:
    """Wrap the example's transformer_config (after the adaptor's import, as the example does)."""
    import torch  # noqa: F401

    import npuspeed.megatron_adaptor  # noqa: F401  (reads the flags from sys.argv, as in the example)
    from launch import EXAMPLE

    sys.path.insert(0, str(EXAMPLE.parent))
    from gpt_example import train

    left, right = (int(x) for x in window.split(","))
    make = train.transformer_config

    def transformer_config(args):
        config = make(args)
        config.window_size = (left, right)
        return config

    train.transformer_config = transformer_config


if __name__ == "__main__":
    from launch import run_then_dump

    if os.environ.get(WINDOW):
        _with_window(os.environ[WINDOW])
    run_then_dump("--attention-json", _collect)
