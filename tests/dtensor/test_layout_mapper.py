"""LayoutMapper rules, overrides, validation and summary; make_mesh."""

import re

import keras
import pytest

from keras_dist.dtensor import LayoutMapper, make_mesh

CPUS = ["cpu:0", "cpu:1", "cpu:2", "cpu:3"]


def mesh(**shape):
    devices = CPUS[: int(__import__("math").prod(shape.values()))]
    return make_mesh(shape, devices)


def mlp():
    return keras.Sequential([
        keras.Input((8,)),
        keras.layers.Dense(32, activation="relu", name="up"),
        keras.layers.Dense(16, name="down"),
        keras.layers.Dense(1, name="head"),
    ], name="mlp")


def transformer_block(heads=4, dim=16):
    inputs = keras.Input((5, dim))
    h = keras.layers.MultiHeadAttention(heads, 8, name="attn")(inputs, inputs)
    h = keras.layers.LayerNormalization(name="norm")(h + inputs)
    h = keras.layers.Dense(64, activation="relu", name="fc1")(h)
    h = keras.layers.Dense(dim, name="fc2")(h)
    return keras.Model(inputs, h, name="block")


def test_mlp_pairs_column_then_row_and_keeps_an_output_of_one_replicated():
    layouts = LayoutMapper(mesh(model=2), min_elements=0).layouts(mlp())
    assert layouts == {
        "mlp/up/kernel": (None, "model"),
        "mlp/up/bias": ("model",),
        "mlp/down/kernel": ("model", None),
    }


def test_four_way_and_two_dimensional_meshes():
    four = LayoutMapper(mesh(model=4), min_elements=0).layouts(mlp())
    assert four["mlp/up/kernel"] == (None, "model")
    grid = LayoutMapper(mesh(batch=2, model=2), min_elements=0).layouts(mlp())
    assert grid == LayoutMapper(mesh(model=2), min_elements=0).layouts(mlp())


def test_attention_shards_heads_and_norms_stay_replicated():
    layouts = LayoutMapper(mesh(model=2), min_elements=0).layouts(transformer_block())
    for name in ("query", "key", "value"):
        assert layouts[f"attn/{name}/kernel"] == (None, "model", None)
        assert layouts[f"attn/{name}/bias"] == ("model", None)
    assert layouts["attn/attention_output/kernel"] == ("model", None, None)
    assert "attn/attention_output/bias" not in layouts
    assert not any(path.startswith("norm") for path in layouts)
    assert layouts["fc1/kernel"] == (None, "model")
    assert layouts["fc2/kernel"] == ("model", None)


def test_attention_with_heads_not_divisible_stays_replicated():
    layouts = LayoutMapper(mesh(model=4), min_elements=0).layouts(
        transformer_block(heads=2))
    assert not any("attn" in path for path in layouts)


@pytest.mark.parametrize("embedding, axes", [("vocabulary", ("model", None)),
                                              ("dim", (None, "model"))])
def test_embedding_shards_vocabulary_or_dimension(embedding, axes):
    model = keras.Sequential([keras.Input((3,), dtype="int32"),
                              keras.layers.Embedding(100, 8, name="emb")], name="e")
    layouts = LayoutMapper(mesh(model=2), embedding=embedding,
                           min_elements=0).layouts(model)
    assert layouts == {"e/emb/embeddings": axes}


@pytest.mark.parametrize("conv", [
    keras.layers.Conv2D(8, 3, name="conv"),
    keras.layers.SeparableConv2D(8, 3, name="conv"),
    keras.layers.DepthwiseConv2D(3, depth_multiplier=2, name="conv"),
    keras.layers.Conv2DTranspose(8, 3, name="conv"),
])
def test_convolutions_stay_replicated_and_say_why(conv):
    # DTensor's convolution requires a fully replicated filter: a sharded one
    # fails at the first step ("Filter for convolution must have fully
    # replicated layout"), so the mapper replicates it and refuses a rule
    # that shards it, and so does shard() for a LayoutMap.
    model = keras.Sequential([keras.Input((8, 8, 4)), conv,
                              keras.layers.BatchNormalization(name="bn")], name="c")
    mapper = LayoutMapper(mesh(model=2), min_elements=0)
    assert mapper.layouts(model) == {}
    reasons = mapper.replicated_reasons(model)
    assert {reasons[w.path] for w in conv.weights} == {
        "convolution: DTensor runs it only replicated"}
    assert reasons["c/bn/gamma"] == "normalization layer"
    lines = []
    mapper.summary(model, print_fn=lines.append)
    assert any("c/conv/" in line and "DTensor runs it only replicated" in line
               for line in lines)
    kernel = conv.weights[0]
    shape = tuple(kernel.shape)
    dim = max(d for d, size in enumerate(shape) if size % 2 == 0)  # one that splits
    axes = tuple("model" if d == dim else None for d in range(len(shape)))
    with pytest.raises(ValueError, match=re.escape(kernel.path) + ".*belongs to a "
                       "convolution.*Map it to None"):
        LayoutMapper(mesh(model=2), rules={re.escape(kernel.path): axes}).layouts(model)


def test_summary_says_why_each_replicated_variable_is():
    inputs = keras.Input((6,))
    h = keras.layers.Dense(64, name="up")(inputs)
    h = keras.layers.Dense(32, name="down")(h)
    h = keras.layers.LayerNormalization(name="norm")(h)
    outputs = keras.layers.Dense(3, name="head")(h)
    model = keras.Model(inputs, outputs, name="m")
    mapper = LayoutMapper(mesh(model=2), min_elements=100, rules={"down/kernel": None})
    assert mapper.replicated_reasons(model) == {
        "up/bias": "fewer than min_elements=100 elements",
        "down/kernel": "rule 'down/kernel'",
        "down/bias": "bias of a row-parallel layer (added after the all-reduce)",
        "norm/gamma": "normalization layer",
        "norm/beta": "normalization layer",
        "head/kernel": "output dimension 3 does not divide by model=2",
        "head/bias": "output dimension 3 does not divide by model=2",
    }


def test_small_variables_stay_replicated_by_default():
    layouts = LayoutMapper(mesh(model=2)).layouts(mlp())  # min_elements=1024
    assert layouts == {}
    big = keras.Sequential([keras.Input((64,)), keras.layers.Dense(64, name="a"),
                            keras.layers.Dense(64, name="b")], name="big")
    assert LayoutMapper(mesh(model=2)).layouts(big) == {
        "big/a/kernel": (None, "model"), "big/b/kernel": ("model", None)}


def test_user_rules_override_and_replicate():
    mapper = LayoutMapper(mesh(model=2), min_elements=0, rules={
        r".*/up/kernel": ("model", None),   # override the automatic layout
        r".*/up/bias": None,                # replicate
        r".*/head/kernel": (None, None),    # replicate (explicit)
    })
    layouts = mapper.layouts(mlp())
    assert layouts == {"mlp/up/kernel": ("model", None),
                       "mlp/down/kernel": ("model", None)}


def test_a_variable_matching_two_rules_is_an_error():
    mapper = LayoutMapper(mesh(model=2), rules={r".*kernel": None, r"mlp/up/.*": None})
    with pytest.raises(ValueError, match="'mlp/up/kernel' matches more than one rule"):
        mapper.layouts(mlp())


def test_layout_map_has_keras_semantics():
    model = mlp()
    layout_map = LayoutMapper(mesh(batch=2, model=2), min_elements=0).layout_map(model)
    assert isinstance(layout_map, keras.distribution.LayoutMap)
    assert layout_map["mlp/up/kernel"].axes == (None, "model")
    assert layout_map["mlp/up/kernel"].device_mesh.shape == (2, 2)
    assert layout_map["mlp/head/kernel"] is None  # replicated


def test_non_divisible_dimension_names_variable_dimension_and_axis():
    mapper = LayoutMapper(mesh(model=4), rules={r"mlp/head/kernel": (None, "model")})
    with pytest.raises(ValueError) as info:
        mapper.layouts(mlp())
    message = str(info.value)
    assert "'mlp/head/kernel'" in message and "dimension 1 of size 1" in message
    assert "mesh axis 'model' of size 4" in message


@pytest.mark.parametrize("rules, message", [
    ({r"mlp/up/kernel": ("model",)}, "has 1 entries"),
    ({r"mlp/up/kernel": ("model", "model")}, "uses a mesh axis twice"),
])
def test_bad_layouts_for_a_variable(rules, message):
    with pytest.raises(ValueError, match=message):
        LayoutMapper(mesh(model=2), rules=rules).layouts(mlp())


@pytest.mark.parametrize("kwargs, error, message", [
    ({"model_axis": "tensor"}, ValueError, "model_axis='tensor'"),
    ({"embedding": "rows"}, ValueError, "embedding='rows'"),
    ({"min_elements": -1}, ValueError, "min_elements=-1"),
    ({"rules": [("a", None)]}, TypeError, "rules="),
    ({"rules": {"(": None}}, ValueError, "Invalid regex"),
    ({"rules": {"a": ("data", None)}}, ValueError, "'data' is not an axis"),
])
def test_bad_arguments(kwargs, error, message):
    with pytest.raises(error, match=message):
        LayoutMapper(mesh(model=2), **kwargs)


def test_mesh_must_be_a_keras_device_mesh():
    with pytest.raises(TypeError, match="DeviceMesh"):
        LayoutMapper({"model": 2})


def test_unbuilt_model_is_refused():
    model = keras.Sequential([keras.layers.Dense(4)])
    with pytest.raises(ValueError, match="needs a built model"):
        LayoutMapper(mesh(model=2)).layouts(model)


def test_summary_reports_bytes_per_device():
    lines = []
    LayoutMapper(mesh(model=2), min_elements=0).summary(mlp(), print_fn=lines.append)
    text = "\n".join(lines)
    # up: kernel 8x32 + bias 32, down: kernel 32x16 + bias 16, head: 16 + 1.
    replicated = 4 * (8 * 32 + 32 + 32 * 16 + 16 + 16 + 1)
    per_device = 4 * ((8 * 32 + 32 + 32 * 16) // 2 + 16 + 16 + 1)
    assert f"total: {replicated:,} bytes replicated" in text
    assert f"{per_device:,} bytes per device with this map" in text
    assert "mlp/up/kernel" in text and "(None, 'model')" in text


def test_make_mesh():
    grid = make_mesh({"batch": 2, "model": 2})
    assert grid.axis_names == ["batch", "model"] and grid.shape == (2, 2)
    with pytest.raises(ValueError, match="needs 8 devices; there are 4"):
        make_mesh({"batch": 2, "model": 4})
    with pytest.raises(ValueError, match="positive integer"):
        make_mesh({"model": 0}, CPUS[:1])
    with pytest.raises(TypeError, match="mapping"):
        make_mesh([("model", 2)])


def test_fully_sharded_splits_each_large_variable_at_its_first_dimension_that_divides():
    from keras_dist.dtensor import FullySharded

    inputs = keras.Input((6,), dtype="int32")
    h = keras.layers.Embedding(30, 8, name="emb")(inputs)  # 240 elements: 30 % 4 no, 8 % 4
    h = keras.layers.Conv1D(12, 3, name="conv")(h)  # kernel (3, 8, 12): 3 no, 8 yes
    h = keras.layers.LayerNormalization(name="norm")(h)  # 12 + 12: small
    h = keras.layers.Flatten()(h)
    outputs = keras.layers.Dense(3, name="head")(h)  # kernel (48, 3): 48
    model = keras.Model(inputs, outputs)
    assert FullySharded(min_elements=100).layouts(model, mesh(batch=4)) == {
        "emb/embeddings": (None, "batch"),
        "conv/kernel": (None, "batch", None),
        "head/kernel": ("batch", None),
    }
    # On a mesh with a model axis too: only the data-parallel axis is used.
    assert FullySharded(min_elements=250).layouts(model, mesh(batch=2, model=2)) == {
        "conv/kernel": (None, "batch", None),
    }


@pytest.mark.parametrize("kwargs, message", [
    ({"min_elements": -1}, "Argument `min_elements` must be a non-negative integer"),
    ({"min_elements": 1.5}, "Received: min_elements=1.5"),
    ({"axis": ""}, "Argument `axis` must be the name of the mesh axis"),
])
def test_fully_sharded_names_a_bad_argument(kwargs, message):
    from keras_dist.dtensor import FullySharded

    with pytest.raises(ValueError, match=re.escape(message)):
        FullySharded(**kwargs)


def test_fully_sharded_needs_its_axis_on_the_mesh():
    from keras_dist.dtensor import FullySharded

    with pytest.raises(ValueError, match=re.escape(
            "FullySharded splits variables over the mesh axis 'batch', which the mesh "
            "does not have (its axes: ['model'])")):
        FullySharded().layouts(mlp(), mesh(model=2))
