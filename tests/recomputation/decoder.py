"""A small pre-norm decoder layer as PaddleNLP's and PaddleFormers' llama-style models build
one (norms, attention with dropout, MLP, residuals), shared by the tests of the sublayer
policies (test_saved_sublayers.py, test_budget.py)."""

import paddle

from helpers import nonzero_biases

D, F, ROWS = 8, 12, 5


class MLP(paddle.nn.Layer):
    """``down(silu(gate(h)) * up(h))``; ``inside`` (an :data:`IN_PLACE` op) changes ``h``,
    the sublayer's own input, in place first."""

    def __init__(self, inside=None):
        super().__init__()
        self.gate = paddle.nn.Linear(D, F)
        self.up = paddle.nn.Linear(D, F)
        self.down = paddle.nn.Linear(F, D)
        self.inside = inside

    def forward(self, h):
        if self.inside is not None:
            h = self.inside(h)
        return self.down(paddle.nn.functional.silu(self.gate(h)) * self.up(h))


class Attention(paddle.nn.Layer):
    """Single-head attention with dropout on the probabilities (random draws inside)."""

    def __init__(self):
        super().__init__()
        self.q_proj = paddle.nn.Linear(D, D)
        self.k_proj = paddle.nn.Linear(D, D)
        self.o_proj = paddle.nn.Linear(D, D)
        self.dropout = paddle.nn.Dropout(0.25)

    def forward(self, h):
        p = paddle.nn.functional.softmax(self.q_proj(h) @ self.k_proj(h).T)
        return self.o_proj(self.dropout(p) @ h)


class Decoder(paddle.nn.Layer):
    """A pre-norm decoder layer; dropout after attention (random draws after a kept
    sublayer); ``after`` (an :data:`IN_PLACE` op) applied to the MLP's output once it
    returned (a residual written in place)."""

    def __init__(self, after=None, inside=None):
        super().__init__()
        self.input_layernorm = paddle.nn.LayerNorm(D)
        self.self_attn = Attention()
        self.post_attention_layernorm = paddle.nn.LayerNorm(D)
        self.mlp = MLP(inside)
        self.dropout = paddle.nn.Dropout(0.1)
        self.after = after
        nonzero_biases(self)

    def forward(self, h):
        h = h + self.dropout(self.self_attn(self.input_layernorm(h)))
        m = self.mlp(self.post_attention_layernorm(h))
        if self.after is not None:
            m = self.after(m)
        return paddle.tanh(h + m)


def custom_forward(layer):
    """As PaddleNLP and PaddleFormers hand a layer to recompute: a closure over it."""

    def run(*inputs):
        return layer(*inputs)

    return run
