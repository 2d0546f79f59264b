"""Tiny random target models for fast tests."""
import torch

from ddtree.models.decoder import DecoderLM, ModelConfig


def tiny_model(model_type="llama", vocab=6, layers=2, std=0.35, seed=0, heads=4, kv_heads=2, head_dim=8):
    """head_dim 8 runs on the torch paths only: the Triton attention's dot products need >= 16."""
    qwen3 = model_type == "qwen3"
    cfg = ModelConfig(model_type=model_type, vocab_size=vocab, hidden_size=32, intermediate_size=64,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                      head_dim=head_dim,
                      rms_norm_eps=1e-6 if qwen3 else 1e-5, rope_theta=10000.0, max_position_embeddings=256,
                      tie_word_embeddings=qwen3, attention_bias=False, qk_norm=qwen3)
    torch.manual_seed(seed)
    model = DecoderLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                p.normal_(0, std)
    return model.eval()
