"""GPT pretraining on megatron.core alone, accelerated by npuspeed.

    torchrun --nproc-per-node 2 examples/pretrain_gpt.py --tensor-model-parallel-size 2 \
        --sequence-parallel --use-cpu-initialization

The only npuspeed-specific line is the adaptor import right after `import torch`; a bad
flag ends the run with one `npuspeed: error: ...` line and exit status 2.
"""
import os
import sys

import torch  # noqa: F401

import npuspeed.megatron_adaptor  # noqa: F401  (parses flags, picks the device, applies patches)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from gpt_example.args import parse_args  # noqa: E402
from gpt_example.train import main  # noqa: E402
from npuspeed.errors import exit_on_user_error  # noqa: E402

if __name__ == "__main__":
    with exit_on_user_error():
        main(parse_args())
