"""A tiny fixture served under its own name, checked against the transformers outputs in its
`reference.json` (`scripts/make_fixtures.py`, `scripts/make_v4_fixture.py`): the greedy
continuation as text, and a prompt's log-probabilities."""

import json
import math
from pathlib import Path

from tokenizers import Tokenizer


class FixtureReference:
    """Fixture `name` (a directory of `fixtures/`) and its transformers reference."""

    def __init__(self, fixtures: Path, name: str):
        self.dir = fixtures / name
        self.name = name
        self.ref = json.loads((self.dir / "reference.json").read_text())

    def expected_text(self) -> str:
        """The greedy continuation transformers generated, decoded as the server decodes."""
        tok = Tokenizer.from_file(str(self.dir / "tokenizer.json"))
        return tok.decode(self.ref["greedy"]["generated_token_ids"], skip_special_tokens=True)

    def greedy(self, client, **kw):
        """The greedy continuation of the reference prompt, as a completion (`stream=True`
        streams it)."""
        g = self.ref["greedy"]
        return client.completions.create(
            model=self.name, prompt=g["prompt_token_ids"],
            max_tokens=len(g["generated_token_ids"]), temperature=0,
            extra_body={"ignore_eos": True}, **kw)

    def check_greedy(self, client):
        """The greedy continuation, whole and streamed, is transformers'."""
        want = self.expected_text()
        r = self.greedy(client)
        assert r.choices[0].text == want
        assert r.usage.completion_tokens == len(self.ref["greedy"]["generated_token_ids"])
        streamed = "".join(c.choices[0].text for c in self.greedy(client, stream=True)
                           if c.choices)
        assert streamed == want

    def check_prompt_logprobs(self, client, ids, logits):
        """The log-probability of each token of prompt `ids` given the ones before it is
        transformers' (from its `logits`, one row per position) within 1e-4."""
        r = client.completions.create(model=self.name, prompt=ids, max_tokens=0, echo=True,
                                      logprobs=1)
        lp = r.choices[0].logprobs
        assert len(lp.token_logprobs) == len(ids) and lp.token_logprobs[0] is None
        for j in range(1, len(ids)):
            row = logits[j - 1]
            m = max(row)
            lse = m + math.log(sum(math.exp(x - m) for x in row))
            assert abs(lp.token_logprobs[j] - (row[ids[j]] - lse)) < 1e-4, j
