"""Transformer building blocks (Megatron's ``core/transformer``), shared by the models.

``transformer_config`` (``TransformerConfig``: what the layers read), ``transformer_layer``
(``TransformerLayer``), ``attention`` (``ParallelAttention``: tensor-parallel self-attention with
GQA, rotary and the context-parallel dispatch), ``dot_product_attention`` (``causal_attention``:
the core attention by backend) and ``blocked_attention`` (its XLA loop), ``mlp``
(``ParallelMLP``), ``rotary_pos_embedding``, ``norms`` (LayerNorm / RMSNorm), ``layer_context``
(``LayerContext`` and layout-invariant dropout), ``utils`` (weight init), ``recompute``
(activation recompute policies) and ``moe`` (mixture of experts). They are built on
``core.tensor_parallel``'s layers and never import ``core.models``.
"""
