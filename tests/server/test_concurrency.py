"""32 concurrent greedy streams each get exactly the tokens they get alone."""

import threading
from concurrent.futures import ThreadPoolExecutor

from conftest import MODEL_NAME, cli_generate, completion_prompt_tokens, wait_until

SPEAKERS = [
    "ROMEO:", "JULIET:", "KING HENRY:", "HAMLET:", "OPHELIA:", "MACBETH:", "LADY MACBETH:",
    "KING LEAR:", "CORDELIA:", "OTHELLO:", "IAGO:", "DESDEMONA:", "PROSPERO:", "MIRANDA:",
    "FALSTAFF:", "PRINCE HAL:", "BRUTUS:", "CASSIUS:", "MARK ANTONY:", "CLEOPATRA:",
    "PORTIA:", "SHYLOCK:", "ROSALIND:", "ORLANDO:", "VIOLA:", "MALVOLIO:", "PUCK:", "OBERON:",
    "TITANIA:", "BOTTOM:", "RICHARD:", "First Citizen:",
]
MAX_TOKENS = 16


def run_stream(client, prompt):
    text, finish, usage, n_chunks = "", None, None, 0
    for chunk in client.completions.create(
        model=MODEL_NAME, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, stream=True,
        stream_options={"include_usage": True},
    ):
        n_chunks += 1
        if chunk.choices:
            text += chunk.choices[0].text
            if chunk.choices[0].finish_reason:
                assert finish is None, "two finish_reasons"
                finish = chunk.choices[0].finish_reason
        if chunk.usage is not None:
            assert usage is None, "two usage chunks"
            usage = chunk.usage
    assert finish is not None and usage is not None
    return text, finish, usage.prompt_tokens, usage.completion_tokens


def test_32_concurrent_streams_equal_their_solo_runs(server, metrics):
    assert len(set(SPEAKERS)) == 32
    client = server.client(timeout=180.0)
    solo = {p: run_stream(client, p) for p in SPEAKERS}
    for p, (text, finish, n_prompt, n_gen) in solo.items():
        ref = cli_generate(p, MAX_TOKENS)
        assert text == ref.text, p
        assert finish == ref.finish_reason, p
        assert n_prompt == len(completion_prompt_tokens(p)), p
        assert n_gen == len(ref.token_ids), p

    before = metrics()
    barrier = threading.Barrier(len(SPEAKERS))

    def together(prompt):
        c = server.client(timeout=180.0)  # a connection of its own each
        barrier.wait(timeout=60)
        return run_stream(c, prompt)

    with ThreadPoolExecutor(max_workers=len(SPEAKERS)) as pool:
        results = dict(zip(SPEAKERS, pool.map(together, SPEAKERS)))

    mismatches = {p: (results[p], solo[p]) for p in SPEAKERS if results[p] != solo[p]}
    assert not mismatches, f"{len(mismatches)} of 32 differ (concurrent, solo): {mismatches}"

    wait_until(lambda: metrics().get("deepinfer_kv_blocks_in_use", default=None) == 0, 5)
    after = metrics()
    total_gen = sum(r[3] for r in results.values())
    assert after.get("deepinfer_generation_tokens_total") - before.get(
        "deepinfer_generation_tokens_total") == total_gen
    finished = sum(after.outcome(o) - before.outcome(o) for o in ["stop", "length"])
    assert finished == 32
    assert after.get("deepinfer_num_requests_running", default=None) == 0
    assert after.get("deepinfer_kv_blocks_in_use", default=None) == 0
