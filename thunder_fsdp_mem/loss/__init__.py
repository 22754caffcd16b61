"""The loss inside the traced step: ``LossModel`` (``modules``: a litgpt model and its cross-entropy, jitted together),
the chunked linear cross-entropy operator (``operator``) and the rewrite that puts it in a trace (``rewrite``)."""
