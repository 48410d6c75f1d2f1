"""Paraphrased questions for the stability check, written by the controller when one is available.

A capable controller (whole-workflow mode) is asked once per question of the rollouts a paraphrase check
uses; it sees the question alone. Unusable replies (see :func:`~eviback.ape.controller.paraphrase_of`) and
failed calls fall back to the rule-based rewording, and are counted. Paraphrases given in
``data.paraphrases`` win. The result is logged, so a resumed run reuses it; the sealed test's questions are
paraphrased only once the test split has been opened.
"""

from __future__ import annotations

from collections.abc import Sequence

from eviback.ape.context import StageContext
from eviback.ape.controller import PARAPHRASE_SLOT, ChatController, paraphrase_messages, paraphrase_of
from eviback.ape.events import QuestionsParaphrased
from eviback.ape.rollouts import Rollout
from eviback.teacher.chat import TeacherCallError


def paraphrase_questions(ctx: StageContext, rollouts: Sequence[Rollout]) -> None:
    """Ask the controller for the paraphrases still missing for `rollouts`' questions (once, logged)."""
    controller = ctx.controller()
    if controller is None or (isinstance(controller, ChatController) and controller.settings.skeletons):
        return  # no controller, or a small one filling skeletons: the rule-based rewording stands
    questions = {r.question_id: r.trajectory.question.question for r in rollouts}
    missing = sorted(q for q in questions if q not in ctx.state.paraphrases and q not in ctx.state.paraphrase_fallbacks)
    if not missing:
        return
    written, fallbacks = [], []
    for qid in missing:
        slot = PARAPHRASE_SLOT + int.from_bytes(qid.encode()[:6].ljust(6, b"\0"), "big") % 1_000_000
        try:
            reply = controller.propose(paraphrase_messages(questions[qid]), slot=slot, stage="paraphrase").text
        except TeacherCallError:
            reply = ""
        text = paraphrase_of(reply, questions[qid])
        if text is None:
            fallbacks.append(qid)
        else:
            written.append((qid, text))
    ctx.emit(QuestionsParaphrased(controller.controller_id, tuple(written), tuple(fallbacks)))
    ctx.progress(f"controller paraphrases: {len(written)} written, {len(fallbacks)} fell back to the rewording")
