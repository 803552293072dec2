"""The device layer of the features (always on): the feature and --npuspeed-device
(device_feature.py), its patches (patches.py), its plan effect (plan.py: none), and the
mechanism, one module per point (cuda_shim.py, rng.py, megatron_fixes.py, dist_backend.py, ...)."""
from npuspeed.features.device import (
    cuda_shim, determinism, dist_backend, distopt_fixes, gloo_collectives, megatron_compat, megatron_fixes, rng,
)
from npuspeed.features.device.apex_guard import guard_apex
from npuspeed.features.device.device_feature import DeviceFeature, log

__all__ = ["DeviceFeature", "guard_apex", "log", "cuda_shim", "determinism", "dist_backend", "distopt_fixes",
           "gloo_collectives", "megatron_compat", "megatron_fixes", "rng"]
