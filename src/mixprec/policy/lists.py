"""Every default list, as data.

Two families:

* The **level lists** (O1, O2): which module classes and functions run in low precision
  (:data:`WHITE_MODULES`, :data:`WHITE_FUNCTIONS`) and which module classes stay in float32
  (:data:`BLACK_MODULES`). These are what :func:`mixprec.get_white_list` and
  :func:`mixprec.get_black_list` return copies of.
* The **autocast lists**, keyed by the op names mixprec sees in a graph (``"linear"``,
  ``"softmax"``, ...): for each device, which ops run low, which run in float32, and which
  run in the widest floating type of their inputs. They reproduce, op by op, the decisions
  ``torch.autocast`` makes (``aten/src/ATen/autocast_mode.cpp``), lifted from aten ops to the
  Python-level functions a traced graph contains (``cross_entropy`` rather than
  ``cross_entropy_loss``; composites such as ``einsum`` whose inner matmuls autocast casts).

Nothing here is mutable: tuples and frozensets only.
"""

from __future__ import annotations

import operator
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "AUTOCAST_LOW_MODULES",
    "BLACK_MODULES",
    "CPU_FP32_OPS",
    "CPU_LOWER_OPS",
    "CPU_PROMOTE_OPS",
    "CUDA_FP32_OPS",
    "CUDA_LOWER_OPS",
    "CUDA_PROMOTE_OPS",
    "FP32_STATE_MODULES",
    "MODULE_OPS",
    "WHITE_FUNCTIONS",
    "WHITE_MODULES",
]

# --------------------------------------------------------------------------- level lists

# recurrent layers and attention: white-listed as a whole, and run whole in low precision
_SEQUENCE_MODULES: tuple[type[nn.Module], ...] = (
    nn.LSTM,
    nn.GRU,
    nn.RNN,
    nn.LSTMCell,
    nn.GRUCell,
    nn.RNNCell,
    nn.MultiheadAttention,
)

#: Module classes that compute in low precision under O1.
WHITE_MODULES: tuple[type[nn.Module], ...] = (
    nn.Linear,
    nn.Bilinear,
    nn.Conv1d,
    nn.Conv2d,
    nn.Conv3d,
    nn.ConvTranspose1d,
    nn.ConvTranspose2d,
    nn.ConvTranspose3d,
    *_SEQUENCE_MODULES,
)

#: Functions (and their Tensor-method and operator forms) that compute in low precision under O1.
WHITE_FUNCTIONS: tuple[Callable[..., object], ...] = (
    F.linear,
    F.bilinear,
    F.conv1d,
    F.conv2d,
    F.conv3d,
    F.conv_transpose1d,
    F.conv_transpose2d,
    F.conv_transpose3d,
    torch.matmul,
    torch.Tensor.matmul,
    operator.matmul,
    torch.mm,
    torch.bmm,
    torch.addmm,
    torch.baddbmm,
    torch.addbmm,
    torch.einsum,
    F.scaled_dot_product_attention,
    F.prelu,
    F.relu,
    torch.relu,
    torch.Tensor.relu,
)

#: Module classes kept in float32 under O2 (normalisation layers).
BLACK_MODULES: tuple[type[nn.Module], ...] = (
    nn.BatchNorm1d,
    nn.BatchNorm2d,
    nn.BatchNorm3d,
    nn.SyncBatchNorm,
    nn.LayerNorm,
    nn.GroupNorm,
    nn.InstanceNorm1d,
    nn.InstanceNorm2d,
    nn.InstanceNorm3d,
    nn.LocalResponseNorm,
    *((nn.RMSNorm,) if hasattr(nn, "RMSNorm") else ()),
)

#: Modules that keep float32 parameters and running statistics even when they compute in
#: low precision (O3): their kernels take a low-precision input with float32 state
#: (cuDNN requires it, and the CPU kernels support it), and their statistics, updated in
#: place, are never rounded to 16 bits.
FP32_STATE_MODULES: tuple[type[nn.Module], ...] = (nn.modules.batchnorm._NormBase,)

# ------------------------------------------------------------------------ autocast lists
# Op names are what mixprec.convert.ops.op_name() returns for a call: the function's
# ``__name__`` with dunders and the reflected ``r`` stripped (``x @ w`` -> "matmul").

#: Modules the autocast level runs whole in low precision when their forward cannot be
#: traced (recurrent layers and attention, whose aten kernels autocast casts down).
AUTOCAST_LOW_MODULES: tuple[type[nn.Module], ...] = _SEQUENCE_MODULES

#: Built-in modules whose forward cannot be traced but which are one op each: the graph
#: keeps them as single calls decided by that op's name.
MODULE_OPS: tuple[tuple[type[nn.Module], str], ...] = (
    (nn.BatchNorm1d, "batch_norm"),
    (nn.BatchNorm2d, "batch_norm"),
    (nn.BatchNorm3d, "batch_norm"),
    (nn.SyncBatchNorm, "batch_norm"),
    (nn.InstanceNorm1d, "instance_norm"),
    (nn.InstanceNorm2d, "instance_norm"),
    (nn.InstanceNorm3d, "instance_norm"),
)

_COMMON_LOWER = (
    "conv1d",
    "conv2d",
    "conv3d",
    "conv_tbc",
    "conv_transpose1d",
    "conv_transpose2d",
    "conv_transpose3d",
    "prelu",
    "addmm",
    "addbmm",
    "baddbmm",
    "bmm",
    "mm",
    "matmul",
    "linear",
    "linalg_vecdot",
    "_addmm_activation",
    "scaled_dot_product_attention",
    "multi_head_attention_forward",
    # a composite whose inner matmuls autocast casts down
    "einsum",
)

#: Ops ``torch.autocast("cpu")`` runs in low precision.
CPU_LOWER_OPS: frozenset[str] = frozenset(
    (
        *_COMMON_LOWER,
        "chain_matmul",
        "linalg_multi_dot",
        "multi_dot",
        "tensordot",
        "linalg_matmul",
        "affine_grid",
        "linalg_pinv",
        "linalg_matrix_power",
        "matrix_power",
        "_native_multi_head_attention",
    )
)

#: Ops ``torch.autocast("cuda")`` runs in low precision.
CUDA_LOWER_OPS: frozenset[str] = frozenset(
    (
        *_COMMON_LOWER,
        "addmv",
        "addr",
        "mv",
        "chain_matmul",
        "linalg_multi_dot",
        "multi_dot",
        "lstm_cell",
        "gru_cell",
        "rnn_tanh_cell",
        "rnn_relu_cell",
    )
)

_LOSSES = (
    "cross_entropy",
    "nll_loss",
    "kl_div",
    "l1_loss",
    "smooth_l1_loss",
    "huber_loss",
    "mse_loss",
    "margin_ranking_loss",
    "multilabel_margin_loss",
    "soft_margin_loss",
    "triplet_margin_loss",
    "multi_margin_loss",
    "binary_cross_entropy_with_logits",
    "hinge_embedding_loss",
    "cosine_embedding_loss",
    "poisson_nll_loss",
)

#: Ops ``torch.autocast("cpu")`` runs in float32.
CPU_FP32_OPS: frozenset[str] = frozenset(
    (
        *_LOSSES,
        "binary_cross_entropy",
        "ctc_loss",
        "nll_loss2d",
        "reflection_pad1d",
        "reflection_pad2d",
        "replication_pad1d",
        "replication_pad2d",
        "replication_pad3d",
        "avg_pool3d",
        "lp_pool3d",
        "local_response_norm",
        "max_pool3d",
        "adaptive_avg_pool3d",
        "adaptive_max_pool3d",
        "fractional_max_pool2d",
        "fractional_max_pool3d",
        "max_unpool1d",
        "max_unpool2d",
        "max_unpool3d",
        "grid_sample",
        "grid_sampler",
        "polar",
        "prod",
        "quantile",
        "nanquantile",
        "stft",
        "cdist",
        "trace",
        "view_as_complex",
        "cholesky",
        "cholesky_inverse",
        "cholesky_solve",
        "inverse",
        "lu_solve",
        "orgqr",
        "ormqr",
        "pinverse",
        "geqrf",
        "qr",
        "svd",
        "triangular_solve",
        "fft_fft",
        "fft_ifft",
        "fft_fft2",
        "fft_ifft2",
        "fft_fftn",
        "fft_ifftn",
        "fft_rfft",
        "fft_irfft",
        "fft_rfft2",
        "fft_irfft2",
        "fft_rfftn",
        "fft_irfftn",
        "fft_hfft",
        "fft_ihfft",
        "linalg_cond",
        "linalg_matrix_rank",
        "linalg_solve",
        "linalg_cholesky",
        "linalg_cholesky_ex",
        "linalg_svdvals",
        "linalg_eigvals",
        "linalg_eigvalsh",
        "linalg_inv",
        "linalg_inv_ex",
        "linalg_householder_product",
        "linalg_tensorinv",
        "linalg_tensorsolve",
        "linalg_qr",
        "linalg_svd",
        "linalg_eig",
        "linalg_eigh",
        "linalg_lstsq",
        "fake_quantize_per_tensor_affine",
    )
)

#: Ops ``torch.autocast("cuda")`` runs in float32.
CUDA_FP32_OPS: frozenset[str] = frozenset(
    (
        *_LOSSES,
        "acos",
        "asin",
        "cosh",
        "erfinv",
        "exp",
        "expm1",
        "log",
        "log10",
        "log2",
        "log1p",
        "reciprocal",
        "rsqrt",
        "sinh",
        "tan",
        "pow",
        "softplus",
        "layer_norm",
        "group_norm",
        "norm",
        "frobenius_norm",
        "nuclear_norm",
        "normalize",
        "cosine_similarity",
        "dist",
        "pdist",
        "cdist",
        "renorm",
        "logsumexp",
        "interpolate",
        "upsample",
        "upsample_nearest",
        "upsample_bilinear",
        # fp32_set_opt_dtype / fp32_append_dtype: run in float32, float32 result
        "prod",
        "softmax",
        "log_softmax",
        "softmin",
        "cumprod",
        "cumsum",
        "sum",
        "linalg_vector_norm",
        "linalg_matrix_norm",
        "linalg_norm",
    )
)

#: Ops ``torch.autocast("cpu")`` runs in the widest floating type among their inputs.
CPU_PROMOTE_OPS: frozenset[str] = frozenset(("cat", "concat", "concatenate", "stack", "index_copy"))

#: Ops ``torch.autocast("cuda")`` runs in the widest floating type among their inputs.
CUDA_PROMOTE_OPS: frozenset[str] = frozenset(
    (
        "addcdiv",
        "addcmul",
        "atan2",
        "bilinear",
        "cross",
        "linalg_cross",
        "dot",
        "vdot",
        "grid_sample",
        "grid_sampler",
        "index_put",
        "tensordot",
        "scatter_add",
    )
)
