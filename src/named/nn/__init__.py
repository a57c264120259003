"""named.nn: Equinox modules over NamedArrays."""

from .._remat import Remat, ScanCheckpointPolicy, checkpoint_name, remat_policy
from . import _lora as lora  # nn.lora.apply / merge / trainable
from . import _mup as mup  # nn.mup.rescale_init / scale_updates / roles
from ._attention import (
    attention_implementation,
    attention_keeps_scores,
    auto_attention,
    dot_product_attention,
    dot_product_attention_weights,
)
from ._basic import (  # activations by function; nn.activation(name) finds each by name
    ACTIVATIONS,
    MLP,
    Dropout,
    activation,
    celu,
    elu,
    gelu,
    glu,
    hard_sigmoid,
    hard_silu,
    hard_swish,
    hard_tanh,
    leaky_relu,
    log_sigmoid,
    mish,
    quick_gelu,
    relu,
    relu6,
    relu_squared,
    selu,
    sigmoid,
    silu,
    soft_sign,
    softplus,
    swish,
)
from ._blockseq import BlockSeq
from ._conv import Conv, ConvTranspose
from ._explicit_stack import ExplicitStack, explicit_layers
from ._gathered_dot import gather_per_use
from ._linear import Embedding, Linear
from ._lora import LoraLinear
from ._masks import (
    alibi_bias,
    alibi_slopes,
    causal_mask,
    chunked_mask,
    forgetful_causal_mask,
    padding_mask,
    segment_mask,
)
from ._moe import MoE, load_balancing_loss, route, router_losses, router_stats, router_z_loss
from ._moe_linear import MoELinear
from ._norm import LayerNorm, RMSNorm
from ._pool import max_pool, mean_pool, min_pool
from ._quant import (  # low-precision Linears: nn.quantize(model, "fp8")
    Fp8Linear,
    Fp8State,
    Int8Linear,
    Int8WeightLinear,
    QuantConfig,
    is_overwrite_state,
    overwrite_updates,
    quantize,
    without_overwrites,
)
from ._rotary import positions_from_segments, rotary_embedding
from ._stacked import Stacked
from .loss import (
    binary_cross_entropy_loss,
    blockwise_cross_entropy_loss,
    blockwise_next_token_loss,
    cross_entropy_loss,
    next_token_loss,
    next_token_targets,
)
from .precision import (
    DynamicLossScale,
    all_finite,
    cast_for_compute,
    cast_output,
    cast_to_param,
    get_policy,
    keeps_full_precision,
)
