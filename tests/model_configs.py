"""Config dicts of real shapes shared by tests (values as in the published configs)."""

LLAMA_8B = dict(model_type="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                num_attention_heads=32, num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=False)

# Qwen3-Next-style hybrid: every 4th layer full attention, the rest Gated DeltaNet, MoE MLPs
HYBRID = dict(model_type="qwen3_next", hidden_size=2048, num_hidden_layers=8, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, vocab_size=151936, intermediate_size=5120,
              full_attention_interval=4, linear_num_key_heads=16, linear_num_value_heads=32,
              linear_key_head_dim=128, linear_value_head_dim=128, linear_conv_kernel_dim=4,
              num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
              shared_expert_intermediate_size=512, decoder_sparse_step=1)
