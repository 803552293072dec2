"""The one line a training script adds: `import npuspeed.megatron_adaptor`.

Importing it reads npuspeed's flags (command line and NPUSPEED_ARGS), picks the
accelerator, validates the requested features, and applies their patches to Megatron,
once. Put it right after `import torch`, before anything from megatron is imported.
A bad flag or an unusable device ends the script here with one line,
`npuspeed: error: ...`, and exit status 2 (npuspeed/errors.py; NPUSPEED_DEBUG=1 for the
traceback).
"""
from npuspeed.errors import exit_on_user_error
from npuspeed.runtime import initialize

with exit_on_user_error():
    initialize()
