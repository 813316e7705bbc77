"""A tiny random Llama, made locally with transformers (nothing downloaded), its weights in several
.safetensors files. Run with the vLLM environment's python: make_model.py DIR"""
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

torch.manual_seed(0)
config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                     num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256,
                     tie_word_embeddings=False, torch_dtype="float32")
model = LlamaForCausalLM(config).to(torch.float32)
model.save_pretrained(sys.argv[1], safe_serialization=True, max_shard_size="300KB")
