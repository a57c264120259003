"""named.nn: Equinox modules over NamedArrays."""

from ._attention import dot_product_attention, positions_from_segments, rotary_embedding
from ._masks import (
    alibi_bias,
    alibi_slopes,
    causal_mask,
    chunked_mask,
    padding_mask,
    segment_mask,
)
from ._basic import ACTIVATIONS, MLP, Dropout, activation
from ._linear import Embedding, Linear
from ._norm import LayerNorm, RMSNorm
from ._blockseq import BlockSeq
from ._remat import Remat, checkpoint_name, remat_policy
from ._stacked import Stacked
from .loss import (
    blockwise_cross_entropy_loss,
    blockwise_next_token_loss,
    cross_entropy_loss,
    next_token_loss,
    next_token_targets,
)
from .precision import cast_for_compute, cast_output, cast_to_param, get_policy, keeps_full_precision
