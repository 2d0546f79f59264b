from ddtree.models.decoder import DecoderLM, ModelConfig
from ddtree.models.dflash import DFlashConfig, DFlashDrafter

__all__ = ["DecoderLM", "ModelConfig", "DFlashConfig", "DFlashDrafter"]
