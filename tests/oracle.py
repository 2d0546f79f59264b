"""A test drafter that knows the target's greedy continuation (from an AR reference run).

Per depth it puts the true next token first with probability p_top, second (behind a random
decoy) with p_second, and otherwise nowhere near the top, so DDTree trees see long accepted
paths, accepted side branches and rejections."""
import torch


class OracleDrafter:
    taps = ()

    def __init__(self, reference: dict, vocab_size: int, block_size: int = 8, p_top: float = 0.65,
                 p_second: float = 0.25, seed: int = 0):
        self.reference, self.vocab_size, self.block_size = reference, vocab_size, block_size
        self.p_top, self.p_second = p_top, p_second
        self.gen = torch.Generator().manual_seed(seed)

    def draft_logprobs(self, seqs) -> torch.Tensor:
        depth, V = self.block_size - 1, self.vocab_size
        logits = torch.randn(len(seqs), depth, V, generator=self.gen)
        for i, seq in enumerate(seqs):
            prompt = tuple(seq.token_ids[:seq.num_prompt_tokens])
            full = list(prompt) + list(self.reference[prompt])
            for d in range(1, depth + 1):
                pos = len(seq) - 1 + d
                if pos >= len(full):
                    break
                true = full[pos]
                r = float(torch.rand((), generator=self.gen))
                if r < self.p_top:
                    logits[i, d - 1, true] = 12.0
                elif r < self.p_top + self.p_second:
                    decoy = int(torch.randint(V, (), generator=self.gen))
                    logits[i, d - 1, decoy] = 12.0
                    logits[i, d - 1, true] = 11.0 if decoy != true else 12.0
                else:
                    logits[i, d - 1, true] = -20.0
        return torch.log_softmax(logits, -1)
