"""The attention role's MoE layer: gate, router and shared experts stay here; routed experts run
on the FFN role.

Where each part of an MoE block runs:

| part                              | attention role | FFN role |
|-----------------------------------|----------------|----------|
| attention, norms, embedding, head | yes            | no       |
| dense MLPs (DeepSeek's first layers) | yes         | no       |
| shared experts                    | yes            | no       |
| gate + top-k routing              | if ``compute_gate_on_attention`` | otherwise |

A model that computes its router logits itself (Mixtral, ...: ``afd_common.vllm_glue.models``)
routes on the attention role only.
| routed experts (weighted by top-k) | no            | yes      |
| ``routed_scaling_factor``, + shared | yes          | no       |

The remote call is the opaque custom op ``torch.ops.afd.remote_experts`` so ``torch.compile``
traces around it instead of into the network code.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
from vllm.model_executor.layers.fused_moe.runner.moe_runner import MoERunner
from vllm.model_executor.models.utils import PPMissingLayer
from vllm.utils.torch_utils import direct_register_custom_op

from afd_attention import session as afd_session


class _NoQuantMethod:
    """What vLLM's MoE code reads from ``routed_experts.quant_method`` when no kernel exists."""

    is_monolithic = False
    topk_indices_dtype = None
    skip_forward_padding = False
    has_unpadded_output = False
    moe_kernel = None
    mk_can_overlap_shared_experts = False
    supports_internal_mk = False


class AFDRemoteRoutedExperts(PPMissingLayer, RoutedExperts):
    """Routed experts without weights. As a ``PPMissingLayer`` the checkpoint loaders skip their
    tensors, so the attention role never reads or holds a routed-expert weight."""

    def __init__(self, layer_name, params_dtype, moe_config, quant_config, expert_map_manager=None,
                 **kwargs):
        nn.Module.__init__(self)
        self.layer_name = layer_name
        self.moe_config = moe_config
        self.expert_map_manager = expert_map_manager
        self.global_num_experts = moe_config.num_experts
        self.local_num_experts = moe_config.num_local_experts
        self.top_k = moe_config.experts_per_token
        self.activation = moe_config.activation
        self.quant_method = _NoQuantMethod()

    def _ensure_moe_quant_config_init(self):
        pass

    def load_weights(self, weights):
        for _ in weights:  # AutoWeightsLoader hands them over; they belong to the FFN role
            pass
        return []

    def get_expert_weights(self):
        return []

    def forward_modular(self, x, topk_weights, topk_ids, shared_experts=None,
                        shared_experts_input=None):
        return torch.ops.afd.remote_experts(x, topk_weights, topk_ids, self.layer_name)


class AFDAttentionMoERunner(MoERunner):
    """``MoERunner`` whose routed part is remote: the same arithmetic as vLLM's fused call
    (checked bit-exact in float32), with routing done here or on the FFN role."""

    def forward(self, hidden_states, router_logits, input_ids=None, shared_experts_input=None):
        x = hidden_states
        if afd_session.current().gate_on_attention:
            # As vLLM's runner: its own gate when the model handed it one, else the model's
            # logits (afd_common.vllm_glue.models refuses the gate on the FFN role for such a
            # model).
            logits = router_logits if self.gate is None else self.gate(x)[0]
            topk_weights, topk_ids = self.router.select_experts(
                hidden_states=x, router_logits=logits, topk_indices_dtype=None,
                input_ids=input_ids)
            routed = torch.ops.afd.remote_experts(x, topk_weights, topk_ids, self.layer_name)
        else:
            routed = torch.ops.afd.remote_experts(x, None, None, self.layer_name)
        shared = None
        if self._shared_experts is not None:
            shared = self._shared_experts._layer(
                x if shared_experts_input is None else shared_experts_input)
            if isinstance(shared, tuple):
                shared = shared[0]
        if self.routed_scaling_factor != 1.0:
            # vLLM's fp16 rule: scale the shared part down instead of the routed part up.
            if routed.dtype != torch.float16 or shared is None:
                routed = routed * self.routed_scaling_factor
            else:
                shared = shared * (1.0 / self.routed_scaling_factor)
        return routed if shared is None else shared + routed


def _remote_experts(x: torch.Tensor, topk_weights: torch.Tensor | None,
                    topk_ids: torch.Tensor | None, layer_name: str) -> torch.Tensor:
    return afd_session.current().remote_experts(layer_name, x, topk_weights, topk_ids)


def _remote_experts_fake(x, topk_weights, topk_ids, layer_name):
    return torch.empty_like(x)


_LIB = torch.library.Library("afd", "FRAGMENT")
direct_register_custom_op("remote_experts", _remote_experts, mutates_args=[],
                          fake_impl=_remote_experts_fake, target_lib=_LIB)
