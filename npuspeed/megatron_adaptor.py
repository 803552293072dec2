"""The one line a training script adds: `import npuspeed.megatron_adaptor`.

Importing it reads npuspeed's flags (command line and NPUSPEED_ARGS), picks the
accelerator, validates the requested features, and applies their patches to Megatron,
once. Put it right after `import torch`, before anything from megatron is imported.
"""
from npuspeed.runtime import initialize

initialize()
