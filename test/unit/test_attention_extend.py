"""importance_torch's extend: new tokens attend to their prefix without placeholder queries."""

import pytest
import torch

from sgl_importance.attention.torch_backend import extend_causal_attention


def _whole_sequence_reference(q_new, k_seq, v_seq, scaling):
    """torch_native's way: causal SDPA over the whole sequence, keep the new tokens' rows."""
    seq_len, new = k_seq.shape[0], q_new.shape[0]
    q_full = torch.zeros((seq_len,) + tuple(q_new.shape[1:]), dtype=q_new.dtype)
    q_full[seq_len - new :] = q_new
    out = torch.nn.functional.scaled_dot_product_attention(
        q_full.transpose(0, 1)[None],
        k_seq.transpose(0, 1)[None],
        v_seq.transpose(0, 1)[None],
        is_causal=True,
        scale=scaling,
        enable_gqa=q_new.shape[1] != k_seq.shape[1],
    )
    return out[0].transpose(0, 1)[seq_len - new :]


@pytest.mark.parametrize("q_heads,kv_heads", [(4, 4), (9, 3)])
def test_extend_over_a_cached_prefix_equals_attention_over_the_whole_sequence(q_heads, kv_heads):
    torch.manual_seed(0)
    head_dim, slots = 16, 256
    k_buffer = torch.randn(slots, kv_heads, head_dim)
    v_buffer = torch.randn(slots, kv_heads, head_dim)
    # Three requests: no prefix (a first chunk), a long prefix and one new token,
    # a prefix and a chunk; their slots are scattered over the pool.
    seq_lens, new_lens = [20, 57, 33], [20, 1, 12]
    perm = torch.randperm(slots - 1) + 1
    req_to_token = torch.zeros(4, 64, dtype=torch.int32)
    offset = 0
    for r, n in enumerate(seq_lens):
        req_to_token[r + 1, :n] = perm[offset : offset + n].to(torch.int32)
        offset += n
    q = torch.randn(sum(new_lens), q_heads, head_dim)
    out = torch.full_like(q, float("nan"))
    extend_causal_attention(
        q,
        out,
        k_buffer,
        v_buffer,
        req_to_token,
        torch.tensor([1, 2, 3]),
        torch.tensor(seq_lens),
        torch.tensor(new_lens),
        scaling=0.25,
    )
    start = 0
    for r, (n, new) in enumerate(zip(seq_lens, new_lens)):
        slots_r = req_to_token[r + 1, :n].long()
        want = _whole_sequence_reference(q[start : start + new], k_buffer[slots_r], v_buffer[slots_r], 0.25)
        torch.testing.assert_close(out[start : start + new], want, rtol=1e-5, atol=1e-5)
        start += new
