"""A data source for rollout tests: numbered groups of a one-token prompt, as the real source numbers them."""

from verst.types import Sample, expand_group


class NumberedSource:
    """Group i is prompt `p{i}` (metadata `data_index` i) with sample indices from i·n; remembers every group it
    handed out and every prompt returned to it, and saves and restores its position."""

    def __init__(self):
        self.position, self.groups, self.returned = 0, [], []

    def next_groups(self, n_prompts, n):
        out = []
        for _ in range(n_prompts):
            index = self.position
            prompt = Sample(tokens=[1, 2], prompt=f"p{index}", metadata={"data_index": index})
            self.groups.append(expand_group(prompt, n, index, index * n))
            out.append(self.groups[-1])
            self.position += 1
        return out

    def return_prompts(self, samples):
        self.returned.append(samples[0].group_index)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]
