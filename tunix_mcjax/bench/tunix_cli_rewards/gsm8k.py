"""The gsm8k task's reward (`tasks.gsm8k_answer_correct`), as a Tunix CLI reward module."""

from tunix_mcjax import tasks


def answer_correct(prompts, completions, answer, **fields) -> list[float]:
    return tasks.gsm8k_answer_correct(prompts=prompts, completions=completions, answer=answer)
