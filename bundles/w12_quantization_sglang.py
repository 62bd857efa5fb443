"""SGLang classes for the ``w12`` quantization method; imported only inside an SGLang process.

``install()`` runs when the plugin activates the ``w12`` bundle: it adds ``w12`` to
``QUANTIZATION_METHODS`` (read by ``ModelConfig._verify_quantization`` and
``get_quantization_config``) and to the ``--quantization`` choices, so
``python -m sglang.launch_server ... --quantization w12`` loads a bf16 checkpoint, converts every
linear layer at load with a bit-for-bit check, and runs the W12 GEMM. Other layers (embeddings,
the LM head, MoE experts) stay unquantized.
"""

from __future__ import annotations

from . import w12_quantization as core

NAME = "w12"


def _classes():
    import torch
    from sglang.srt.layers.linear import LinearBase
    from sglang.srt.layers.quantization.base_config import LinearMethodBase, QuantizationConfig

    class W12LinearMethod(LinearMethodBase):
        def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size,
                           output_size, params_dtype, **extra_weight_attrs):
            core.create_weights(layer, input_size_per_partition, output_partition_sizes, params_dtype,
                                **extra_weight_attrs)

        def process_weights_after_loading(self, layer):
            core.process_weights_after_loading(layer)

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
                return W12LinearMethod()
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
