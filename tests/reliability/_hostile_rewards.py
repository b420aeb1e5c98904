"""User reward functions that misbehave, loaded by path (`task.reward=<this file>:<name>`) in the tests."""

import math
import os
import sys
import time


def ok(completion, example):
    return 1.0


def digit_fraction(completion, example):
    """Fraction of digits in the completion: a dense reward whose groups almost never tie (gradients flow)."""
    return sum(ch.isdigit() for ch in completion) / max(len(completion), 1)


def hang(completion, example):
    time.sleep(3600)


def crash(completion, example):
    raise RuntimeError("boom")


def calls_sys_exit(completion, example):
    sys.exit(3)


def raises_keyboard_interrupt(completion, example):
    raise KeyboardInterrupt


def returns_text(completion, example):
    return "not a number"


def returns_none(completion, example):
    return None


def returns_nan(completion, example):
    return math.nan


def returns_huge_int(completion, example):
    return 10 ** 400


def flaky(completion, example):
    """Fails on every completion that contains the digit 1, else rewards 1."""
    if "1" in completion:
        raise ValueError("flaky")
    return 1.0


def hard_exit(completion, example):
    os._exit(7)
