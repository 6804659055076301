"""importance_torch's extend: new tokens attend to their prefix without placeholder queries."""

import functools

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


def test_an_extend_attends_released_prefix_pages_from_their_host_copies_exactly():
    """Streamed prefill: a request's earlier chunks live only in the host pool (its row shows
    the padding slot there); the extend reads them back and its output is bit-for-bit the
    one with every page on the device."""
    torch.manual_seed(1)
    page, kv_heads, q_heads, head_dim = 4, 2, 4, 8
    k_buffer = torch.randn(128, kv_heads, head_dim)
    v_buffer = torch.randn(128, kv_heads, head_dim)
    seq_len, new = 40, 8  # 32 cached (8 pages), 8 new
    req_to_token = torch.zeros(2, 64, dtype=torch.int32)
    req_to_token[1, :seq_len] = torch.arange(16, 16 + seq_len, dtype=torch.int32)
    q = torch.randn(new, q_heads, head_dim)
    args = (req_to_token, torch.tensor([1]), torch.tensor([seq_len]), torch.tensor([new]))
    dense = torch.empty_like(q)
    extend_causal_attention(q, dense, k_buffer, v_buffer, *args, scaling=0.3)
    # Pages 1, 2 and 5 released: their K/V moved to a "host" pool, the row points at padding
    # and the device slots are overwritten (as the allocator would reuse them).
    released = torch.tensor([1, 2, 5])
    positions = (released[:, None] * page + torch.arange(page)).flatten()
    host_k, host_v = torch.zeros(64, kv_heads, head_dim), torch.zeros(64, kv_heads, head_dim)
    host_slots = torch.arange(40, 40 + positions.numel())
    device_slots = req_to_token[1, positions].long()
    host_k[host_slots], host_v[host_slots] = k_buffer[device_slots], v_buffer[device_slots]
    k_buffer[device_slots], v_buffer[device_slots] = torch.randn(2, positions.numel(), kv_heads, head_dim)
    req_to_token[1, positions] = 0
    reads = []

    def read_host(slots):
        reads.append(slots)
        return host_k[slots], host_v[slots]

    streamed = torch.empty_like(q)
    extend_causal_attention(
        q, streamed, k_buffer, v_buffer, *args, scaling=0.3, released=[(positions, host_slots)], read_host=read_host
    )
    assert torch.equal(streamed, dense)
    assert len(reads) == 1 and torch.equal(reads[0], host_slots)
    # Without the host reads the released positions are padding: a different output.
    blind = torch.empty_like(q)
    extend_causal_attention(q, blind, k_buffer, v_buffer, *args, scaling=0.3)
    assert not torch.allclose(blind, dense)


def test_the_extends_seed_is_the_last_tokens_page_mass_as_a_decode_step_reports_it():
    """``seed``: each request's last new token's mass per page and KV head, what the decode
    reference reports for that query over the same keys (``--hot-set-first-step seeded``)."""
    from sgl_kernel_ext.reference import decode_importance_reference

    torch.manual_seed(1)
    q_heads, kv_heads, head_dim, page, slots = 4, 2, 16, 4, 128
    k_buffer, v_buffer = torch.randn(slots, kv_heads, head_dim), torch.randn(slots, kv_heads, head_dim)
    seq_lens, new_lens = [23, 18], [7, 18]
    req_to_token = torch.zeros(3, 32, dtype=torch.int32)
    req_to_token[1, :23] = torch.arange(1, 24, dtype=torch.int32)
    req_to_token[2, :18] = torch.arange(40, 58, dtype=torch.int32)
    q = torch.randn(sum(new_lens), q_heads, head_dim)
    seeds = {}
    extend_causal_attention(
        q, torch.empty_like(q), k_buffer, v_buffer, req_to_token, torch.tensor([1, 2]), torch.tensor(seq_lens),
        torch.tensor(new_lens), scaling=0.25, seeds=[functools.partial(seeds.__setitem__, i) for i in range(2)],
        page_size=page,
    )  # fmt: skip
    last = torch.stack([q[new_lens[0] - 1], q[-1]])
    indices = torch.cat([req_to_token[1, :23], req_to_token[2, :18]]).long()
    want = decode_importance_reference(
        last, k_buffer, v_buffer, torch.tensor([0, 23, 41]), indices, page_size=page, sm_scale=0.25,
        mask_page0=False, compute_dtype=torch.float64,
    ).importance_per_kv_head  # fmt: skip
    for i, n in enumerate(seq_lens):
        pages = -(-n // page)
        torch.testing.assert_close(seeds[i], want[i, :pages].T.float(), rtol=1e-5, atol=1e-6)
