"""A KV cache too small for the load: sequences are preempted and recomputed, none is dropped,
and each still gets exactly its solo greedy text."""

from concurrent.futures import ThreadPoolExecutor

import httpx

from conftest import MODEL_NAME, Metrics, cli_generate

PROMPTS = ["ROMEO:", "JULIET:", "HAMLET:", "OPHELIA:", "MACBETH:", "IAGO:"]
MAX_TOKENS = 60


def test_preempted_requests_finish_with_their_solo_text(server_factory):
    # 128-token sequences need 8 blocks of 16; 9 blocks hold one at full length, so six
    # concurrent ones must take turns.
    srv = server_factory("--max-len", "128", "--kv-blocks", "9", "--max-batch", "8")
    client = srv.client(timeout=300.0)

    def run(prompt):
        r = client.completions.create(
            model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True},
        )
        return r.choices[0].text, r.choices[0].finish_reason, r.usage.completion_tokens

    with ThreadPoolExecutor(max_workers=len(PROMPTS)) as pool:
        results = dict(zip(PROMPTS, pool.map(run, PROMPTS)))

    for p in PROMPTS:
        ref = cli_generate(p, MAX_TOKENS)
        assert results[p] == (ref.text, "length", MAX_TOKENS), p
    m = Metrics(httpx.get(f"{srv.base_url}/metrics", timeout=30).text)
    assert m.get("deepinfer_num_preemptions_total") > 0, "the cache was large enough"
    assert m.get("deepinfer_kv_blocks_in_use", default=None) == 0
    assert m.get("deepinfer_kv_blocks_total", default=None) == 8
