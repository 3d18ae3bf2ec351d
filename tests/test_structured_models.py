"""The structured test models are deterministic and have the statistics they claim."""

import torch

from sample_models import structured


def test_cnns_are_deterministic_and_batchnorm_is_not_identity():
    for make, batches in (
        (structured.resnet_cnn, structured.resnet_batches(8, 8)),
        (structured.conv1d_bn, structured.conv1d_batches(8, 8)),
    ):
        a, b = make(), make()
        x = batches[0]["x"]
        with torch.no_grad():
            assert torch.equal(a(x), b(x))
        bns = [m for m in a.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert bns and all(float((m.running_var - 1).abs().max()) > 0.1 for m in bns)
        assert not torch.equal(make(seed=1)(x), a(x))


def test_deep_encoder_has_outliers_an_unused_pooler_and_informative_embeddings():
    model = structured.deep_encoder()
    batch = structured.deep_encoder_batches("eval", 16)[0]
    seen = {}

    def record(name, pick):
        def hook(module, inputs, output):
            seen[name] = pick(inputs, output)  # returns None: the output is left alone

        return hook

    hooks = [
        model.bert.pooler.register_forward_hook(record("pooler", lambda i, o: o)),
        model.bert.encoder.layer[2].output.dense.register_forward_hook(record("down_in", lambda i, o: i[0])),
    ]
    with torch.no_grad():
        out = model(**batch)
    for h in hooks:
        h.remove()
    assert "pooler" in seen  # runs in forward...
    assert out.shape == (batch["input_ids"].shape[0], 384)  # ...but the output is the pooled embedding
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(out.shape[0]))
    # embeddings of different lines are not all one direction
    assert float((out @ out.T).mean()) < 0.5
    # FFN down-projection input: a few channels hold values far above the rest
    x = seen["down_in"].abs().amax(dim=(0, 1))
    assert float(x.max() / x.median()) > 10


def test_pretrained_like_encoder_has_the_statistics_its_docstring_claims():
    from sample_models import pretrained_like

    model = pretrained_like.build()
    batches = pretrained_like.batches("test")
    b = batches[0]
    # real padding: sentences of different lengths padded to the longest
    lengths = b["attention_mask"].sum(1)
    assert b["input_ids"].shape[0] == 32 and int(lengths.max()) == b["input_ids"].shape[1] > int(
        lengths.min()
    )
    assert (b["input_ids"][b["attention_mask"] == 0] == pretrained_like.PAD).all()
    # the splits are disjoint sentences
    calib = {tuple(r.tolist()) for x in pretrained_like.batches("calib") for r in x["input_ids"]}
    assert not calib & {tuple(r.tolist()) for r in b["input_ids"]}
    # outlier residual dimensions: the first encoder input's largest channel far above the median channel
    assert pretrained_like.outlier_ratio(model, b) > 20
    # attention is not uniform: mean entropy well below log(real keys)
    entropy, uniform = pretrained_like.attention_entropy(model, b)
    assert entropy < 0.8 * uniform
    with torch.no_grad():
        out = model(**b)
    torch.testing.assert_close(out.norm(dim=-1), torch.ones(out.shape[0]))
    assert float((out @ out.T).mean()) < 0.5
