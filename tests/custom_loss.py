"""A model of the user's around a sequence-parallel head: a transformers ``PreTrainedModel`` whose forward takes
``labels`` (for a loss of its own) and calls the head without them. The integrations' checks must not take those
labels for the head's."""
import transformers


class CustomLoss(transformers.PreTrainedModel):
    config_class = transformers.PretrainedConfig

    def __init__(self, inner):
        super().__init__(transformers.PretrainedConfig())
        self.inner = inner

    def forward(self, input_ids, labels=None):
        return self.inner(input_ids=input_ids).logits
