"""The shared benchmark workload: chat prompts with lognormal output lengths."""

from __future__ import annotations

import random
from dataclasses import dataclass

from common.text.tokenizer import Tokenizer

QUESTIONS = [
    "What is the capital of France?",
    "Explain how a refrigerator works.",
    "Write a short poem about the sea.",
    "Give me three tips for learning a new language.",
    "What causes the seasons on Earth?",
    "Summarize the plot of Romeo and Juliet in a few sentences.",
    "How do I make a cup of tea?",
    "Why is the sky blue?",
    "List some healthy breakfast ideas.",
    "What is the difference between a virus and a bacterium?",
    "Describe a typical day of a software engineer.",
    "How does compound interest work?",
    "What are the planets of the solar system?",
    "Tell me a fun fact about octopuses.",
    "How can I improve my sleep?",
    "What is photosynthesis?",
]


@dataclass(frozen=True)
class Request:
    prompt: str
    max_tokens: int


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, rng: random.Random) -> list[int]:
    return [max(1, min(cap, round(rng.lognormvariate(0.0, sigma) * median))) for _ in range(n)]


def make_workload(
    tokenizer: Tokenizer,
    n: int = 64,
    seed: int = 0,
    median: float = 32,
    sigma: float = 1.0,
    cap: int = 256,
) -> list[Request]:
    rng = random.Random(seed)
    lengths = lognormal_lengths(n, median, sigma, cap, rng)
    prompts = [
        tokenizer.apply_chat_template([{"role": "user", "content": QUESTIONS[rng.randrange(len(QUESTIONS))]}])
        for _ in range(n)
    ]
    return [Request(p, m) for p, m in zip(prompts, lengths, strict=True)]
