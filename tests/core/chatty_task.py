"""A plugin-like task that reports what it did (``Task.report``) and logs through its own
module logger: both lines must reach train.log (issue #52 item 4)."""

import logging

from tests.core.toy_text import ToyTextTask
from tk.core.metrics import Accuracy

log = logging.getLogger(__name__)


class ChattyTask(ToyTextTask):
    name = "chatty"

    def setup(self, resume: bool = False) -> None:
        super().setup(resume)
        self.report("chatty: 3 rows dropped (empty)")

    def build_model(self):
        log.info("chatty: built by the plugin's own logger")
        return super().build_model()


class NeedsSetupTask(ToyTextTask):
    """Its metrics need ``setup()`` (as label names would)."""

    name = "needs_setup"

    def setup(self, resume: bool = False) -> None:
        super().setup(resume)
        self.topk = (1,)

    def build_metrics(self, split):
        return {"acc": Accuracy(topk=self.topk, ignore_index=-100)}


class DeclaredTask(NeedsSetupTask):
    metric_names = ("top1",)  # what its metrics log, declared for the checks made before set-up
