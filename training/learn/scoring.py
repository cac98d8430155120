"""Token logprobs of a group's sequences with their shared prompt prefix computed once, exactly.

A GRPO group's samples start with the same prompt (system text, tool schemas, the worked example, the
question): usually most of every sequence. :class:`SequenceScorer` runs the model over that common
prefix once and then only each sample's own suffix, attending to the prefix's key/values expanded over
the batch. The logprobs equal those of a full forward pass over each sequence
(:func:`token_logprobs`) up to float rounding, and so does the gradient.

How the prefix's gradient is exact and memory stays bounded by the micro-batch. With a common prefix
of ``P`` tokens the scorer runs the model once over the context ``x[:P-1]`` *with* grad, keeping that
graph. Each suffix batch starts at the last shared token ``x[P-1]`` (so every suffix has a token
even when a sample ends where the prefix does) and attends to *detached copies* of the context's
key/values, which are leaf tensors; likewise the prefix's own token logprobs (a sampled token may
fall inside the common prefix when samples agree on their first tokens) enter each row through a
detached leaf. Every micro-batch's ``loss.backward()`` then frees that micro-batch's graph and
accumulates ``dL/dKV`` and ``dL/dlogp_prefix`` on the leaves; :meth:`SequenceScorer.backward` pushes
those accumulated gradients through the kept context graph once. By the chain rule the parameters get
exactly the gradient of the unshared computation, the context's forward and backward each run once
per group, and peak memory is one context graph plus one micro-batch of suffix graphs (the unshared
path holds a micro-batch of whole sequences). ``retain_graph`` across micro-batches would give the
same gradient but run the context's backward once per micro-batch.

NOTE (positions and padding): suffixes are right-padded; their attention mask is ones over the
context followed by the suffix's own validity, and their position ids continue from the context's
length, as in a full right-padded forward pass. Padding positions get garbage logprobs that the loss
masks out, exactly as in :func:`token_logprobs`.

Two levels. A step's groups share more than their group: every SearchQA episode starts with the same
system text, tool schemas and worked example, and only the question differs. A scorer built with
``parent=`` (a scorer over the whole step) runs only the tokens after the parent's prefix, attending
to the parent's key/value leaves; its :meth:`~SequenceScorer.backward` leaves the gradient on them,
and the parent's ``backward``, called once after every group, sends it through the step's common
context. Same values and gradient again; the common context runs once per step, not once per group.

Sharing needs a common prefix of at least two tokens, two or more sequences and a model whose
key/value cache is a plain per-layer concatenation (``transformers``' ``DynamicLayer``; sliding-window
layers are not); otherwise the scorer falls back to the full forward pass per micro-batch.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from toolgym.training.learn.batching import common_prefix_length
from toolgym.training.learn.chosen_logprobs import Hidden, Logits, chosen_logprobs, run_rows
from toolgym.training.learn.layer_checkpoint import checkpointed_layers, read_only_cache

__all__ = ["SequenceScorer", "token_logprobs", "token_scores"]

log = logging.getLogger(__name__)


class SequenceScorer:
    """Per-token logprobs of the sequences of one group, micro-batch by micro-batch.

    Construct it with all the sequences the group will score (that is where the common prefix is found
    and, when sharing, run once), then call :meth:`logprobs` for each micro-batch and, when ``grad``,
    call :meth:`backward` once after the last micro-batch's ``loss.backward()`` so the prefix's share of
    the gradient reaches the parameters.

    Args:
        model: a ``transformers`` causal LM (or any module with the same call convention).
        sequences: every sequence to be scored through this scorer.
        temperature: logits are divided by it, as when sampling.
        share_prefix: compute the common prefix once (``False``: a full forward pass per micro-batch).
        grad: build the autograd graph (the learner); ``False`` for a reference model.
        pad_id: token id used for right padding (never attended to by real positions).
        masks: per sequence, 1 where the caller reads the logprob (the loss mask); with sharing, logits
            are computed only at positions some sequence reads (see :meth:`logprobs`). ``None`` reads all.
        entropy: also compute each read position's entropy (:meth:`scores`; a diagnostic, no grad).
        checkpoint: run the decoder layers of :meth:`scores`' passes checkpointed (with ``grad``:
            :mod:`~toolgym.training.learn.layer_checkpoint`); the context passes never are.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        sequences: Sequence[Sequence[int]],
        *,
        temperature: float = 1.0,
        share_prefix: bool = True,
        grad: bool = True,
        pad_id: int = 0,
        masks: Sequence[Sequence[int]] | None = None,
        entropy: bool = False,
        parent: SequenceScorer | None = None,
        checkpoint: bool = False,
    ) -> None:
        if not sequences:
            raise ValueError("SequenceScorer needs at least one sequence")
        self.model, self.temperature, self.grad, self.pad_id = model, temperature, grad, pad_id
        self.entropy = entropy
        self.checkpoint = checkpoint and grad
        self._prefix_entropy: torch.Tensor | None = None
        self.device = next(model.parameters()).device
        self.prefix: tuple[int, ...] = ()
        self._leaves: list[torch.Tensor] = []  # detached KV copies, then the prefix logprobs
        self._roots: list[torch.Tensor] = []  # the same tensors inside the context's graph
        shared = common_prefix_length(sequences) if share_prefix and len(sequences) >= 2 else 0
        prefix = tuple(sequences[0][:shared])
        if (
            parent is not None
            and parent.prefix
            and self.grad == parent.grad
            and prefix[: parent.shared] == parent.prefix
        ):
            self._run_context_on(parent, prefix, masks)
        elif shared >= 2:
            self._run_context(prefix, masks)

    @property
    def shared(self) -> int:
        """Tokens computed once for every sequence (0 when the scorer falls back to full passes)."""
        return len(self.prefix)

    def _run_context(self, prefix: tuple[int, ...], masks: Sequence[Sequence[int]] | None) -> None:
        from transformers.cache_utils import DynamicLayer

        context = torch.tensor([prefix[:-1]], dtype=torch.long, device=self.device)
        keep = self._read_rows(masks, 1, len(prefix) - 1)
        with torch.set_grad_enabled(self.grad):
            rows, cache = run_rows(self.model, keep, input_ids=context, use_cache=True)
            layers = getattr(cache, "layers", None)
            if layers is None or any(type(layer) is not DynamicLayer for layer in layers):
                log.debug("prefix sharing off: %s is not a plain dynamic cache", type(cache).__name__)
                return
            targets = torch.tensor([prefix[1:]], dtype=torch.long, device=self.device)
            taken, ent = self._taken(rows, targets, keep)
            logp = taken[0]
            self._prefix_entropy = None if ent is None else ent[0]
        roots = [t for layer in layers for t in (layer.keys, layer.values)] + [logp]
        self._roots = roots if self.grad else []
        self._leaves = [t.detach().requires_grad_(self.grad) for t in roots]
        self.prefix = prefix

    def _run_context_on(
        self, parent: SequenceScorer, prefix: tuple[int, ...], masks: Sequence[Sequence[int]] | None
    ) -> None:
        """The context on top of ``parent``'s: only the tokens after the parent's prefix are run.

        They attend to the parent's key/value leaves, so this context's graph ends in those leaves:
        :meth:`backward` leaves their gradient there, and the parent's ``backward`` sends it on.
        """
        from transformers import DynamicCache

        first = parent.shared
        *kv, parent_logp = parent._leaves
        if len(prefix) == first:  # nothing of its own: the parent's leaves are this scorer's too
            self._leaves, self._roots, self.prefix = parent._leaves, [], prefix
            self._prefix_entropy = parent._prefix_entropy
            return
        context = torch.tensor([prefix[first - 1 : -1]], dtype=torch.long, device=self.device)
        past = DynamicCache(ddp_cache_data=[(kv[i], kv[i + 1]) for i in range(0, len(kv), 2)])
        keep = self._read_rows(masks, first, len(prefix) - first)
        with torch.set_grad_enabled(self.grad):
            rows, cache = run_rows(self.model, keep, input_ids=context, past_key_values=past, use_cache=True)
            layers = cache.layers
            targets = torch.tensor([prefix[first:]], dtype=torch.long, device=self.device)
            taken, ent = self._taken(rows, targets, keep)
            logp = torch.cat([parent_logp, taken[0]])
        if ent is not None and parent._prefix_entropy is not None:
            self._prefix_entropy = torch.cat([parent._prefix_entropy, ent[0]])
        roots = [t for layer in layers for t in (layer.keys, layer.values)] + [logp]
        self._roots = roots if self.grad else []
        self._leaves = [t.detach().requires_grad_(self.grad) for t in roots]
        self.prefix = prefix

    def _read_rows(self, masks: Sequence[Sequence[int]] | None, first: int, rows: int) -> torch.Tensor:
        """Logits rows ``j < rows`` worth computing: row ``j`` predicts token ``first + j``, read if any mask is 1.

        The rest would only feed logprobs that the loss multiplies by 0, so skipping the output layer
        and the softmax over the vocabulary there changes no loss value and no gradient.
        """
        if masks is None:
            return torch.arange(rows, device=self.device)
        keep = [j for j in range(rows) if any(first + j < len(m) and m[first + j] for m in masks)]
        return torch.tensor(keep, dtype=torch.long, device=self.device)

    def _taken(
        self, rows: Hidden | Logits, targets: torch.Tensor, keep: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``[B, rows]`` logprobs of ``targets`` from the kept rows (0.0 at rows not kept), and the
        rows' entropies when the scorer computes them (:mod:`~toolgym.training.learn.chosen_logprobs`)."""
        picked, kept_ent = chosen_logprobs(
            rows, targets[:, keep], temperature=self.temperature, entropy=self.entropy
        )
        out = torch.zeros(targets.shape, dtype=picked.dtype, device=self.device)
        ent = None
        if kept_ent is not None:
            ent = torch.zeros(targets.shape, dtype=picked.dtype, device=self.device).index_copy(
                1, keep, kept_ent
            )
        return out.index_copy(1, keep, picked), ent

    def logprobs(
        self, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]] | None = None
    ) -> torch.Tensor:
        """``[B, T]`` logprobs for right-padded ``sequences``: ``[:, t]`` is ``log p(x_t | x_<t)``, ``[:, 0]`` = 0.

        The same values (and gradient) as :func:`token_logprobs`, ``T`` being
        the longest sequence, at every position that ``masks`` marks (every position without
        ``masks``). With a shared prefix, positions no mask marks (prompt, tool output, padding) are
        0.0: the output layer is not run there, which is a large part of a small model's cost. With a
        shared prefix every sequence must start with it.
        """
        return self.scores(sequences, masks)[0]

    def scores(
        self, sequences: Sequence[Sequence[int]], masks: Sequence[Sequence[int]] | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """:meth:`logprobs`, and each position's entropy ``[B, T]`` when built with ``entropy=True``."""
        if self.prefix and not self._leaves:
            raise RuntimeError("SequenceScorer.logprobs called after backward(); build a new scorer")
        if not self.prefix:
            with checkpointed_layers(self.model, self.checkpoint):
                logp, _, ent = token_scores(
                    self.model,
                    sequences,
                    temperature=self.temperature,
                    pad_id=self.pad_id,
                    entropy=self.entropy,
                )
            return logp, ent
        shared = len(self.prefix)
        for seq in sequences:
            if tuple(seq[:shared]) != self.prefix:
                raise ValueError(
                    f"sequence does not start with the scorer's {shared}-token shared prefix; build the "
                    "SequenceScorer with every sequence it will score"
                )
        batch, context = len(sequences), shared - 1
        suffixes = [list(seq[context:]) for seq in sequences]  # each starts at the last shared token
        width = max(len(s) for s in suffixes)
        ids = torch.full((batch, width), self.pad_id, dtype=torch.long)
        attention = torch.zeros((batch, context + width), dtype=torch.long)
        attention[:, :context] = 1
        for i, suffix in enumerate(suffixes):
            ids[i, : len(suffix)] = torch.tensor(suffix, dtype=torch.long)
            attention[i, context : context + len(suffix)] = 1
        ids, attention = ids.to(self.device), attention.to(self.device)
        *kv, prefix_logp = self._leaves
        # read, never written: a checkpointed layer's recomputation sees the same keys/values
        past = read_only_cache(
            [
                (kv[i].expand(batch, -1, -1, -1), kv[i + 1].expand(batch, -1, -1, -1))
                for i in range(0, len(kv), 2)
            ]
        )
        keep = self._read_rows(masks, shared, width - 1)  # suffix row j predicts token shared + j
        with torch.set_grad_enabled(self.grad), checkpointed_layers(self.model, self.checkpoint):
            rows, _ = run_rows(
                self.model,
                keep,
                input_ids=ids,
                attention_mask=attention,
                past_key_values=past,
                use_cache=True,
            )
            taken, ent = self._taken(rows, ids[:, 1:], keep)
            first = torch.zeros((batch, 1), dtype=taken.dtype, device=self.device)
            logp = torch.cat([first, prefix_logp.expand(batch, -1), taken], dim=1)
        if ent is None or self._prefix_entropy is None:
            return logp, None
        return logp, torch.cat([first, self._prefix_entropy.expand(batch, -1), ent], dim=1)

    def backward(self) -> None:
        """Send the gradient the micro-batches left on the shared prefix through its graph, once.

        Call after the last micro-batch's ``loss.backward()``; the context's graph is freed. A no-op
        without sharing or without grad.
        """
        if not self._roots:  # no graph of its own (no grad, no sharing, or the parent's leaves)
            self._leaves = []
            return
        pairs = [(root, leaf.grad) for root, leaf in zip(self._roots, self._leaves, strict=True)]
        self._roots, self._leaves = [], []
        pairs = [(root, g) for root, g in pairs if g is not None]
        if pairs:
            torch.autograd.backward([root for root, _ in pairs], [g for _, g in pairs])


def token_logprobs(
    model: torch.nn.Module, sequences: Sequence[Sequence[int]], *, temperature: float = 1.0, pad_id: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logprob of each token given its prefix, for right-padded sequences.

    Returns ``(logp, valid)`` of shape ``[B, T]``: ``logp[:, t]`` is ``log p(x_t | x_<t)`` (position 0
    has no prefix and is 0), ``valid`` marks real (non-pad) positions. Logits are divided by the
    sampling temperature so the learner scores the same distribution the policy sampled from.
    """
    logp, valid, _ = token_scores(model, sequences, temperature=temperature, pad_id=pad_id)
    return logp, valid


def token_scores(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int]],
    *,
    temperature: float = 1.0,
    pad_id: int = 0,
    entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """:func:`token_logprobs` plus, with ``entropy``, each position's entropy ``[B, T]`` (no grad).

    ``entropy[:, t]`` is the entropy of the distribution that predicted ``x_t`` (0 at position 0).
    """
    length = max(len(s) for s in sequences)
    ids = torch.full((len(sequences), length), pad_id, dtype=torch.long)
    valid = torch.zeros((len(sequences), length), dtype=torch.long)
    for i, seq in enumerate(sequences):
        ids[i, : len(seq)] = torch.tensor(list(seq), dtype=torch.long)
        valid[i, : len(seq)] = 1
    device = next(model.parameters()).device  # the learner may live on a GPU; results stay there
    ids, valid = ids.to(device), valid.to(device)
    # no cache: nothing reads it, and a checkpointed layer's recomputation must not write it twice
    rows, _ = run_rows(model, None, input_ids=ids, attention_mask=valid, use_cache=False)
    taken, ent_rows = chosen_logprobs(
        rows.first(length - 1), ids[:, 1:], temperature=temperature, entropy=entropy
    )
    zero = torch.zeros((len(sequences), 1), dtype=taken.dtype, device=device)
    logp = torch.cat([zero, taken], dim=1)
    ent = None if ent_rows is None else torch.cat([zero, ent_rows], dim=1)
    return logp, valid, ent
