"""The custom task's reward (docs/data.md): the user's own function, with the argument names the
reward workers pass (docs/reward.md)."""


def says_the_word(completion: str, reference: str) -> float:
    """1.0 when the completion contains the reference word, else 0.0."""
    return float(reference.lower() in completion.lower())
