"""``python -m rl_entry ARGS`` (``PYTHONPATH=tests``): the kdsa CLI with the test environment
``test_first_letter`` registered, for the multi-process RL test's subprocesses."""

import string
import sys

from kdsa.infer.chat import Message
from kdsa.train.rl.envs import Environment, Outcome, Task, register_env


@register_env("test_first_letter")
class FirstLetter(Environment):
    """Reward 1 when the answer starts with a lowercase ASCII letter (~7% of random tokens)."""

    def task(self, index, split="train"):
        return Task(self.domain, index, (Message("user", "Say a word."),))

    def respond(self, task, output, history):
        return Outcome(float(output.content[:1] in string.ascii_lowercase))

    def demonstration(self, task):
        return [Message("assistant", "yes")]


if __name__ == "__main__":
    from kdsa.cli.main import main

    sys.exit(main(sys.argv[1:]))
