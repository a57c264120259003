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
