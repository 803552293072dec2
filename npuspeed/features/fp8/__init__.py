from npuspeed.features.fp8.fp8_feature import Fp8Feature

__all__ = ["Fp8Feature"]
