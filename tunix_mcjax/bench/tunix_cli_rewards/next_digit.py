"""The next_digit task's reward (`tasks.next_digit_correct`), as a Tunix CLI reward module."""

from tunix_mcjax import tasks


def next_digit_correct(prompts, completions, answer, **fields) -> list[float]:
    return tasks.next_digit_correct(prompts=prompts, completions=completions, answer=answer)
