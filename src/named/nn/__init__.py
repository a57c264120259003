"""named.nn: Equinox modules over NamedArrays."""

from ._attention import (
    causal_mask,
    dot_product_attention,
    positions_from_segments,
    rotary_embedding,
    segment_mask,
)
from ._basic import ACTIVATIONS, MLP, Dropout, activation
from ._linear import Embedding, Linear
from ._norm import LayerNorm, RMSNorm
from ._stacked import Stacked, checkpoint_name, remat_policy
from .loss import (
    blockwise_cross_entropy_loss,
    blockwise_next_token_loss,
    cross_entropy_loss,
    next_token_loss,
    next_token_targets,
)
from .precision import cast_for_compute, cast_output, cast_to_param, get_policy, keeps_full_precision
