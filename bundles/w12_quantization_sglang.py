"""SGLang classes for the ``w12`` quantization method; imported only inside an SGLang process.

``install()`` runs when the plugin activates the ``w12`` bundle: it adds ``w12`` to
``QUANTIZATION_METHODS`` (read by ``ModelConfig._verify_quantization`` and
``get_quantization_config``) and to the ``--quantization`` choices, so
``python -m sglang.launch_server ... --quantization w12`` serves every linear layer with the W12
GEMM. Other layers (embeddings, the LM head, MoE experts) stay unquantized.

The checkpoint is either a plain bf16 one (each linear weight encoded at load, its restore checked
bit for bit) or one packed by ``specpilot w12 pack``: :func:`around_get_weights_iterator` restores
each packed weight in the loader's stream (checked bit for bit against the digest of the original)
and keeps its W12 records, which the linear layers then take without re-encoding anything.
"""

from __future__ import annotations

import logging

from . import w12_quantization as core

NAME = "w12"
logger = logging.getLogger(__name__)
# W12 tensors restored from a packed checkpoint, by checkpoint name, until a layer takes them
PACKED: dict = {}


def _classes():
    import torch
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig

    class W12LinearMethod(LinearMethodBase):
        def __init__(self, prefix: str = "", mapping: dict | None = None):
            self.prefix = prefix
            self.mapping = mapping or {}

        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            core.create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                                **extra_weight_attrs)

        def process_weights_after_loading(self, layer):
            core.process_weights_after_loading(layer, PACKED, self.prefix, self.mapping)

        def apply(self, layer, x, bias=None):
            return core.apply(layer, x, bias)

    class W12Config(QuantizationConfig):
        """Lossless 12-bit weights (SpecPilot): online conversion of a bf16 checkpoint."""

        def get_name(self):
            return NAME

        def get_supported_act_dtypes(self):
            return [torch.bfloat16]

        @classmethod
        def get_min_capability(cls):
            return 80

        @staticmethod
        def get_config_filenames():
            return []  # online: get_quant_config() then calls W12Config()

        @classmethod
        def from_config(cls, config):
            return cls()

        def get_quant_method(self, layer, prefix):
            if isinstance(layer, LinearBase):
                return W12LinearMethod(prefix, getattr(self, "packed_modules_mapping", None))
            return None

        def get_scaled_act_names(self):
            return []

    return W12Config, W12LinearMethod


def install() -> None:
    from sglang.srt.arg_groups.choices import QUANTIZATION_CHOICES
    from sglang.srt.layers.quantization import QUANTIZATION_METHODS

    config, _ = _classes()
    QUANTIZATION_METHODS[NAME] = config
    if NAME not in QUANTIZATION_CHOICES:
        QUANTIZATION_CHOICES.append(NAME)


def around_get_weights_iterator(original, self, source, *args, **kwargs):
    """``DefaultModelLoader._get_weights_iterator``: a checkpoint packed by ``specpilot w12 pack``
    streams its packed weights restored (bit-for-bit checked) and hands their W12 records to the
    linear layers (:data:`PACKED`); any other checkpoint streams as stock."""
    weights = original(self, source, *args, **kwargs)
    resolved = kwargs.get("resolved_source")
    try:
        files = (list(resolved.weight_files) if resolved is not None else
                 self._prepare_weights(source.model_or_path, source.revision, source.fall_back_to_pt,
                                       source.allow_patterns_overrides)[1])
    except Exception:  # a source SpecPilot cannot list is loaded as stock (it holds no W12 metadata we know of)
        logger.exception("SpecPilot w12: could not list the checkpoint files; loading it as stock")
        return weights
    tables = core.packed_tables(files)
    if not tables:
        return weights
    import torch

    logger.info("SpecPilot w12: %d packed W12 weights in %s; restoring them bit for bit", len(tables),
                source.model_or_path)
    device = "cuda" if torch.cuda.is_available() else None
    return core.restore_stream(weights, tables, PACKED, device=device)
