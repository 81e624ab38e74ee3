"""Training: regeneration of the data by the target (:mod:`.regenerate`), the losses of the paper's
Section 4.3 (:mod:`.losses`), and the co-training loop (:mod:`.loop`).

Layering: this package sits above the models (``drafter``, ``heads``, ``jacobi``, ``proposer``), the
targets and the decoding engine, and may import all of them; nothing in those modules imports it.
"""
