"""Dumps for finding where two runs part (`--npuspeed-dump DIR`): the feature and its flags
(dump_feature.py), its patches on Megatron's schedules (patches.py), the hooks that see the model
(hooks.py), the statistics (stats.py), the rank's layout (layout.py) and the files (writer.py,
whose format `npuspeed compare` reads)."""
from npuspeed.features.base import FeatureError
from npuspeed.features.dump.dump_feature import DumpFeature

__all__ = ["DumpFeature", "FeatureError"]
