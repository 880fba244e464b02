"""Ops on plain tensors, one package per op (attention, and the fused ops around it); nothing of the model.

castle/          CASTLE and CASTLE-SWL: torch reference, Triton training kernels, custom ops, UQ-KV cache and decoding
forgetting/      Forgetting Attention (FoX): torch reference, Triton kernels, decoding
fused/           the model around attention: chunked linear + cross-entropy, SwiGLU and RMSNorm(+add) kernels
tree.py          Tree attention: exact merge of partial attention over a sharded cache, round-robin cache rows
sdpa.py          choosing SDPA's backend (training vs decoding)
triton_utils.py  what every Triton kernel shares: guarded import, interpreter work-arounds, helpers
"""
