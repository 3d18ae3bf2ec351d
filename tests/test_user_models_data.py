"""Hugging Face model folders, text files and image folders, as users have them (issue 16)."""

import json
import shutil

import numpy as np
import pytest
import torch

from quantcli import load_calibrated
from tests.helpers import assert_clean_error, cli

transformers = pytest.importorskip("transformers")
PIL = pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

WORDS = [
    "[PAD]",
    "[UNK]",
    "[CLS]",
    "[SEP]",
    "[MASK]",
] + "the a cat dog sat on mat good bad movie was is very not".split()
TEXTS = [
    "the cat sat on the mat",
    "a dog was very good",
    "the movie was not bad",
    "very good movie",
    "a cat is a cat",
    "bad dog",
    "the mat was good",
    "not very bad at all",
]


def make_tokenizer(folder):
    """A BERT tokenizer from a small vocab file: no download."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "vocab.txt").write_text("\n".join(WORDS) + "\n")
    return transformers.BertTokenizer.from_pretrained(str(folder), local_files_only=True)


#: an encoder-decoder of one layer each (BART's, Whisper's config fields)
TINY_SEQ2SEQ = dict(
    d_model=16,
    encoder_layers=1,
    decoder_layers=1,
    encoder_attention_heads=2,
    decoder_attention_heads=2,
    encoder_ffn_dim=32,
    decoder_ffn_dim=32,
)
#: one transformer layer of 16 features (a text or an image encoder's config fields)
TINY_LAYER = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32)
#: an encoder of the tiny vocabulary, one layer of 16 features
TINY_ENCODER = dict(vocab_size=len(WORDS), **TINY_LAYER)


def save_folder(model, folder, tokenizer=True):
    """``model`` saved as a Hugging Face folder, with the tiny tokenizer unless ``tokenizer=False``."""
    model.eval().save_pretrained(str(folder))
    if tokenizer:
        make_tokenizer(folder.parent / "vocab").save_pretrained(str(folder))
    return model


def make_bert_folder(folder, head=True, tokenizer=True):
    cfg = transformers.BertConfig(
        **TINY_ENCODER, max_position_embeddings=64, num_labels=3, initializer_range=0.2
    )
    torch.manual_seed(0)
    cls = transformers.BertForSequenceClassification if head else transformers.BertModel
    return save_folder(cls(cfg), folder, tokenizer)


@pytest.fixture(scope="module")
def bert(tmp_path_factory):
    d = tmp_path_factory.mktemp("bert")
    model = make_bert_folder(d / "clf")
    (d / "texts.txt").write_text("\n".join(TEXTS[:5]) + "\n\n" + "\n".join(TEXTS[5:]) + "\n")
    return model, d


def test_classifier_folder_and_text_file(bert, tmp_path):
    model, d = bert
    folder = tmp_path / "clf"
    shutil.copytree(d / "clf", folder)
    out = tmp_path / "clf.calib.pt"
    r = cli("calibrate", folder, "--data", d / "texts.txt", "--out", out, "--json", "--batch-size", "3")
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["num_samples"] == 8 and info["num_batches"] == 3
    assert "max length 64" in info["preprocessing"]  # the default 128, within the model's 64 positions
    ck = load_calibrated(out)
    assert ck.input_names == ["input_ids", "attention_mask", "token_type_ids"]
    # the float model is the folder's classifier: same logits as transformers itself on the same tokens
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = tok(TEXTS, padding=True, return_tensors="pt")
    with torch.inference_mode():
        expected = model(**enc).logits
        got = ck.float_model()(**enc)
    assert set(got) == {"logits"} and torch.allclose(got["logits"], expected, atol=1e-5)
    shutil.rmtree(folder)  # export and verify need nothing from the folder, the tokenizer included
    onnx = tmp_path / "clf.onnx"
    r = cli("export", out, "--onnx", onnx, "--json")
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["output_names"] == ["logits"]
    r = cli("verify", onnx, "--reference", out, "--data", d / "texts.txt", "--json")
    assert r.exit_code == 0, r.output
    rep = json.loads(r.stdout)
    assert rep["num_samples"] == 8 and rep["quality"]["outputs"]["logits"]["cosine"] > 0.99


def test_base_model_mean_pooling_jsonl_and_bin_weights(tmp_path):
    folder = tmp_path / "enc"
    model = make_bert_folder(folder, head=False)
    state = transformers.BertModel.from_pretrained(str(folder)).state_dict()
    (folder / "model.safetensors").unlink()
    torch.save(state, folder / "pytorch_model.bin")  # the older weight format, read with weights_only
    lines = [json.dumps({"text": t, "label": i}) for i, t in enumerate(TEXTS)]
    (tmp_path / "d.jsonl").write_text("\n".join(lines) + "\n")
    out = tmp_path / "enc.calib.pt"
    r = cli(
        "calibrate",
        folder,
        "--pooling",
        "mean",
        "--data",
        tmp_path / "d.jsonl",
        "--max-length",
        "5",
        "--out",
        out,
        "--json",
    )
    assert r.exit_code == 0, r.output
    ck = load_calibrated(out)
    example = ck.example
    assert example["input_ids"].shape[1] == 5  # truncated to --max-length
    tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    enc = tok(TEXTS[:4], padding=True, return_tensors="pt")
    with torch.inference_mode():
        h = model(**enc).last_hidden_state
        m = enc["attention_mask"].unsqueeze(-1).float()
        expected = (h * m).sum(1) / m.sum(1)
        got = ck.float_model()(**enc)
    assert set(got) == {"embeddings"} and torch.allclose(got["embeddings"], expected, atol=1e-5)
    r = cli("calibrate", folder, "--data", tmp_path / "d.jsonl", "--out", tmp_path / "b.calib.pt", "--json")
    assert r.exit_code == 0, r.output
    assert set(load_calibrated(tmp_path / "b.calib.pt").model(**enc)) == {"last_hidden_state"}


def _png(path, array):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(array).save(path)


def _cnn():
    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Conv2d(3, 4, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveAvgPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(4, 2),
    ).eval()


def test_image_folder_decoded_converted_and_normalised(tmp_path):
    torch.save(_cnn(), tmp_path / "cnn.pt")
    imgs = tmp_path / "imgs"
    # a solid colour stays solid when resized
    _png(imgs / "a_red.png", np.full((10, 14, 3), (255, 0, 0), np.uint8))
    _png(imgs / "b_gray.png", np.full((9, 9), 128, np.uint8))  # L: converted to RGB (128, 128, 128)
    _png(imgs / "nested" / "c.png", np.random.default_rng(0).integers(0, 256, (12, 12, 3), dtype=np.uint8))
    out = tmp_path / "cnn.calib.pt"
    r = cli(
        "calibrate",
        tmp_path / "cnn.pt",
        "--trust-pickle",
        "--data",
        imgs,
        "--image-size",
        "6x8",
        "--out",
        out,
        "--json",
    )
    assert r.exit_code == 0, r.output
    info = json.loads(r.stdout)
    assert info["num_samples"] == 3 and "converted to RGB: 1 from L" in info["preprocessing"]
    assert "ImageNet" in info["preprocessing"]
    x = torch.load(out, weights_only=True)["inputs"]["example"]["input"]
    assert x.shape == (3, 3, 6, 8) and x.dtype == torch.float32
    mean, std = torch.tensor([0.485, 0.456, 0.406]), torch.tensor([0.229, 0.224, 0.225])
    red = (torch.tensor([1.0, 0.0, 0.0]) - mean) / std
    gray = (torch.full((3,), 128 / 255) - mean) / std
    assert torch.allclose(x[0], red[:, None, None].expand(3, 6, 8), atol=1e-5)
    assert torch.allclose(x[1], gray[:, None, None].expand(3, 6, 8), atol=1e-5)
    # verify repeats the stored preprocessing
    assert cli("export", out, "--onnx", tmp_path / "c.onnx", "--trust-code").exit_code == 0
    r = cli("verify", tmp_path / "c.onnx", "--reference", out, "--data", imgs, "--trust-code", "--json")
    assert r.exit_code == 0, r.output


def vit_folder(folder, image_size: int = 8, patch_size: int = 4):
    """A one-layer ViT image classifier (2 labels) saved to ``folder``."""
    cfg = transformers.ViTConfig(image_size=image_size, patch_size=patch_size, num_labels=2, **TINY_LAYER)
    torch.manual_seed(0)
    transformers.ViTForImageClassification(cfg).eval().save_pretrained(str(folder))


def test_without_a_preprocessor_config_the_image_size_is_the_configs(tmp_path):
    """A ViT folder of image_size 8 with no preprocessor_config.json: images were resized to 224 and the
    model refused them ("Input image size (224*224) doesn't match model (8*8)"); config.json says 8."""
    vit_folder(tmp_path / "vit")
    _png(tmp_path / "imgs" / "a.png", np.full((20, 30, 3), 128, np.uint8))
    out = tmp_path / "vit.calib.pt"
    r = cli("calibrate", tmp_path / "vit", "--data", tmp_path / "imgs", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert "config.json's image_size" in json.loads(r.stdout)["preprocessing"]
    assert torch.load(out, weights_only=True)["inputs"]["example"]["pixel_values"].shape == (1, 3, 8, 8)


def test_preprocessor_config_gives_the_defaults(tmp_path):
    vit_folder(tmp_path / "vit")
    (tmp_path / "vit" / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "do_resize": True,
                "size": {"height": 8, "width": 8},
                "do_normalize": True,
                "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5],
                "do_rescale": True,
                "rescale_factor": 1 / 255,
            }
        )
    )
    _png(tmp_path / "imgs" / "w.png", np.full((20, 20, 3), 255, np.uint8))
    _png(tmp_path / "imgs" / "k.jpg", np.zeros((20, 30, 3), np.uint8))
    out = tmp_path / "vit.calib.pt"
    r = cli("calibrate", tmp_path / "vit", "--data", tmp_path / "imgs", "--out", out, "--json")
    assert r.exit_code == 0, r.output
    assert "preprocessor_config.json" in json.loads(r.stdout)["preprocessing"]
    x = torch.load(out, weights_only=True)["inputs"]["example"]["pixel_values"]
    assert x.shape == (2, 3, 8, 8)
    assert torch.allclose(x[0], torch.full((3, 8, 8), -1.0)) and torch.allclose(
        x[1], torch.full((3, 8, 8), 1.0)
    )


@pytest.mark.parametrize(
    "kind",
    [
        "resize_then_crop",
        "shortest_edge_then_crop",
        "crop_only",
        "crop_pct",
        "flip_no_normalize",
        "legacy_size",
    ],
)
def test_image_preprocessing_equals_the_hugging_face_processor(tmp_path, kind):
    """The pixels quantcli calibrates and verifies on are the ones the model's own image processor makes
    (transformers' PIL processors, independent of quantcli's code): a DeiT config (resize to 40x40, center
    crop to 32x32, bicubic) was applied as one bilinear resize to 32x32, off by up to 2.0 normalised.
    ConvNext's ``crop_pct`` (the shorter side to shortest_edge / crop_pct, then a center crop) was ignored:
    no crop. MobileViT's (BGR channel order, no normalisation) was normalised in RGB, off by up to 1.8, and a
    legacy integer ``size`` (openai/clip-vit-base-patch32's, the shorter side for CLIP's class) squashed the
    image to a square."""
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil
    from transformers.models.convnext.image_processing_pil_convnext import ConvNextImageProcessorPil
    from transformers.models.deit.image_processing_pil_deit import DeiTImageProcessorPil
    from transformers.models.mobilevit.image_processing_pil_mobilevit import MobileViTImageProcessorPil

    from quantcli.inputs.image_data import image_batches, image_settings

    crop = {"height": 32, "width": 32}
    proc = {
        "resize_then_crop": lambda: DeiTImageProcessorPil(
            size={"height": 40, "width": 40}, crop_size=crop, image_mean=[0.5] * 3, image_std=[0.5] * 3
        ),
        "shortest_edge_then_crop": lambda: CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size=crop),
        "crop_only": lambda: DeiTImageProcessorPil(do_resize=False, crop_size=crop),
        "crop_pct": lambda: ConvNextImageProcessorPil(size={"shortest_edge": 32}, crop_pct=0.875),
        "flip_no_normalize": lambda: MobileViTImageProcessorPil(size={"shortest_edge": 36}, crop_size=crop),
        "legacy_size": lambda: CLIPImageProcessorPil(size={"shortest_edge": 36}, crop_size=crop),
    }[kind]()
    proc.save_pretrained(str(tmp_path / "model"))
    if (
        kind == "legacy_size"
    ):  # as old configs store it: an integer, which CLIP's class reads as the shorter side
        path = tmp_path / "model" / "preprocessor_config.json"
        cfg = json.loads(path.read_text())
        cfg["size"], cfg["crop_size"] = 36, 32
        path.write_text(json.dumps(cfg))
        proc = CLIPImageProcessorPil.from_pretrained(str(tmp_path / "model"))
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for h, w in ((48, 48), (40, 64), (70, 30))]
    for i, a in enumerate(images):
        _png(tmp_path / "imgs" / f"{i}.png", a)
    settings = image_settings(tmp_path / "model", None, None, None)
    (got,) = image_batches(tmp_path / "imgs", _cnn(), "x", settings, 8, None)
    want = np.concatenate([proc(Image.fromarray(a), return_tensors="np")["pixel_values"] for a in images])
    assert got["x"].shape == want.shape == (3, 3, 32, 32)
    np.testing.assert_allclose(got["x"].numpy(), want, atol=1e-5)


@pytest.mark.parametrize("kind", ["levit", "rescale_offset", "no_resize"])
def test_an_image_processor_quantcli_cannot_reproduce_is_refused(tmp_path, kind):
    """LeViT's resize (256/224 of the size, then a crop), EfficientNet's rescale_offset and a processor that
    does not resize were applied as plain resizes, in silence: calibrate and verify both used those pixels,
    so verify passed a graph calibrated on other inputs than deployment gives it. Each is compared with the
    processor itself on probe images and refused, naming it and what to pass instead."""
    from transformers.models.efficientnet.image_processing_pil_efficientnet import (
        EfficientNetImageProcessorPil,
    )
    from transformers.models.levit.image_processing_pil_levit import LevitImageProcessorPil
    from transformers.models.vit.image_processing_pil_vit import ViTImageProcessorPil

    proc = {
        "levit": lambda: LevitImageProcessorPil(
            size={"shortest_edge": 40}, crop_size={"height": 32, "width": 32}
        ),
        "rescale_offset": lambda: EfficientNetImageProcessorPil(
            size={"height": 32, "width": 32}, rescale_offset=True, include_top=False
        ),
        "no_resize": lambda: ViTImageProcessorPil(do_resize=False),
    }[kind]()
    folder = tmp_path / "vit"
    vit_folder(folder, image_size=32, patch_size=8)
    proc.save_pretrained(str(folder))
    _png(tmp_path / "imgs" / "a.png", np.zeros((40, 40, 3), np.uint8))
    out = tmp_path / "m.calib.pt"
    r = cli("calibrate", folder, "--data", tmp_path / "imgs", "--out", out)
    assert_clean_error(r, "preprocessor_config.json", type(proc).__name__, "an .npz of pixel_values")
    assert not out.exists()


def test_token_ids_without_an_attention_mask_are_warned_about(bert, tmp_path):
    """An .npz of input_ids alone for a text model: the graph took no attention_mask and calibrate and
    export said nothing; a deployment padding its batches got other logits on the real tokens."""
    _, d = bert
    ids = np.random.default_rng(0).integers(
        5, transformers.AutoConfig.from_pretrained(d / "clf").vocab_size, (8, 12)
    )
    np.savez(tmp_path / "ids.npz", input_ids=ids)
    np.savez(tmp_path / "both.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    r = cli("calibrate", d / "clf", "--data", tmp_path / "ids.npz", "--out", tmp_path / "a.calib.pt")
    assert r.exit_code == 0, r.output
    assert "forward takes attention_mask, but the data has none" in r.stderr
    r = cli("calibrate", d / "clf", "--data", tmp_path / "both.npz", "--out", tmp_path / "b.calib.pt")
    assert r.exit_code == 0, r.output
    assert "attention_mask" not in r.stderr


def test_a_class_transformers_does_not_export_at_its_top_level_is_found(tmp_path):
    """A WhisperEncoder folder was "a class transformers does not have; upgrade transformers": the class is
    in transformers.models.whisper.modeling_whisper. It is found, and the folder refused for what it is (an
    audio model), with the way to quantize it."""
    cfg = transformers.WhisperConfig(
        **TINY_SEQ2SEQ,
        num_mel_bins=8,
        max_source_positions=16,
    )
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    WhisperEncoder(cfg).save_pretrained(str(tmp_path / "enc"))
    np.savez(tmp_path / "f.npz", input_features=np.zeros((2, 8, 32), np.float32))
    r = cli("calibrate", tmp_path / "enc", "--data", tmp_path / "f.npz", "--out", tmp_path / "e.calib.pt")
    assert_clean_error(r, "WhisperEncoder takes neither input_ids nor pixel_values", "model.py:make")


def test_a_text_and_image_model_folder_is_refused_for_what_it_is(tmp_path):
    """A CLIPModel folder took the text wrapper, which dropped its images: "forward(input_ids, attention_mask)
    failed ... 'NoneType' object has no attribute 'shape'" for text data, and "input 'pixel_values' is not an
    argument of forward" for an .npz that had it, each blaming the model or the data."""
    text = dict(TINY_ENCODER, max_position_embeddings=32)
    vision = dict(TINY_LAYER, image_size=8, patch_size=4)
    cfg = transformers.CLIPConfig(text_config=text, vision_config=vision, projection_dim=8)
    transformers.CLIPModel(cfg).eval().save_pretrained(str(tmp_path / "clip"))
    np.savez(
        tmp_path / "d.npz",
        input_ids=np.ones((2, 4), np.int64),
        pixel_values=np.zeros((2, 3, 8, 8), np.float32),
    )
    r = cli("calibrate", tmp_path / "clip", "--data", tmp_path / "d.npz", "--out", tmp_path / "c.calib.pt")
    assert_clean_error(r, "CLIPModel takes text and images together", "model.py:make")


# ------------------------------------------------------------------------------------------ bad input


def _no_output(d):
    assert not list(d.rglob("*.calib.pt")) and not list(d.rglob(".*.tmp"))


def test_bad_folders_texts_and_images(bert, tmp_path):
    _, d = bert
    texts = d / "texts.txt"
    (tmp_path / "plain").mkdir()
    assert_clean_error(
        cli("calibrate", tmp_path / "plain", "--data", texts), "not a Hugging Face model folder"
    )
    fake = tmp_path / "fake"
    shutil.copytree(d / "clf", fake)
    cfg = json.loads((fake / "config.json").read_text())
    cfg["architectures"] = ["BertForTimeTravel"]
    (fake / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(cli("calibrate", fake, "--data", texts), "BertForTimeTravel", "does not have")
    cfg["architectures"] = ["BertForSequenceClassification"]
    cfg["auto_map"] = {"AutoModel": "modeling_evil.Evil"}
    (fake / "config.json").write_text(json.dumps(cfg))
    assert_clean_error(cli("calibrate", fake, "--data", texts), "auto_map", "never runs code")
    notok = tmp_path / "notok"
    make_bert_folder(notok, tokenizer=False)
    assert_clean_error(cli("calibrate", notok, "--data", texts), "no tokenizer", "--tokenizer")
    for bad in ("0", "-5"):  # 0 was taken as "not given" (128)
        assert_clean_error(
            cli("calibrate", d / "clf", "--data", texts, "--max-length", bad), "--max-length must be positive"
        )
    assert_clean_error(
        cli("calibrate", d / "clf", "--pooling", "mean", "--data", texts), "--pooling", "task head"
    )
    (tmp_path / "empty.txt").write_text("\n  \n")
    assert_clean_error(cli("calibrate", d / "clf", "--data", tmp_path / "empty.txt"), "holds no text")
    (tmp_path / "latin1.txt").write_bytes("ok\ncaf\xe9\n".encode("latin-1"))
    assert_clean_error(cli("calibrate", d / "clf", "--data", tmp_path / "latin1.txt"), "not UTF-8", "line 2")
    (tmp_path / "bad.jsonl").write_text('{"text": "ok"}\n{"label": 1}\n')
    assert_clean_error(cli("calibrate", d / "clf", "--data", tmp_path / "bad.jsonl"), "line 2", '"text"')
    torch.save(_cnn(), tmp_path / "cnn.pt")
    imgs = tmp_path / "imgs"
    _png(imgs / "ok.png", np.zeros((4, 4, 3), np.uint8))
    (imgs / "broken.jpg").write_bytes(b"\xff\xd8\xff not really a jpeg")
    r = cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", imgs)
    assert_clean_error(r, "cannot decode image", "broken.jpg")
    (imgs / "broken.jpg").unlink()
    Image.fromarray(np.full((4, 4), 4000, np.uint16)).save(imgs / "deep.png")
    assert_clean_error(
        cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", imgs), "deep.png", "16-bit"
    )
    (imgs / "deep.png").unlink()
    assert_clean_error(
        cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", imgs, "--mean", "0.5,0.5"),
        "--mean has 2 values",
    )
    assert_clean_error(
        cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", imgs, "--image-size", "big"),
        "--image-size",
    )
    _no_output(tmp_path)


@pytest.mark.parametrize(
    "make",
    [
        lambda: transformers.BartForConditionalGeneration(
            transformers.BartConfig(
                vocab_size=len(WORDS),
                **TINY_SEQ2SEQ,
                max_position_embeddings=64,
            )
        ),
        lambda: transformers.T5ForConditionalGeneration(
            transformers.T5Config(
                vocab_size=len(WORDS),
                d_model=16,
                d_kv=8,
                d_ff=32,
                num_layers=1,
                num_decoder_layers=1,
                num_heads=2,
            )
        ),
    ],
    ids=["bart", "t5"],
)
def test_encoder_decoder_models_are_refused(bert, tmp_path, make):
    """BART exported as a graph of input_ids alone, its decoder fed the shifted input (verify passed it);
    T5 failed with transformers' own 'You must specify exactly one of input_ids or inputs_embeds'."""
    _, d = bert
    torch.manual_seed(0)
    save_folder(make(), tmp_path / "s2s")
    r = cli("calibrate", tmp_path / "s2s", "--data", d / "texts.txt")
    assert_clean_error(r, "ForConditionalGeneration is an encoder-decoder (seq2seq) model")
    _no_output(tmp_path)


def test_roberta_positions_start_after_the_padding_index(bert, tmp_path):
    """RoBERTa numbers positions from padding_idx + 1: with 20 position rows and padding index 0 it holds 19
    tokens. --max-length 20 passed the check, then failed on the example batch with an index error."""
    _, d = bert
    cfg = transformers.RobertaConfig(
        **TINY_ENCODER, max_position_embeddings=20, pad_token_id=0, type_vocab_size=1, num_labels=2
    )
    torch.manual_seed(0)
    save_folder(transformers.RobertaForSequenceClassification(cfg), tmp_path / "rob")
    (tmp_path / "long.txt").write_text(" ".join(TEXTS) + "\n" + TEXTS[0] + "\n")  # 40 words in line 1
    assert_clean_error(
        cli("calibrate", tmp_path / "rob", "--data", tmp_path / "long.txt", "--max-length", "20"),
        "19 positions",
    )
    for extra in (["--max-length", "19"], []):  # the default keeps within the 19 too
        r = cli(
            "calibrate", tmp_path / "rob", "--data", tmp_path / "long.txt", "--out", tmp_path / "r.pt", *extra
        )
        assert r.exit_code == 0, r.output
        assert torch.load(tmp_path / "r.pt", weights_only=True)["inputs"]["shapes"][0] == [2, 19]


def test_missing_extras_are_named(bert, tmp_path, monkeypatch):
    _, d = bert
    torch.save(_cnn(), tmp_path / "cnn.pt")
    _png(tmp_path / "imgs" / "a.png", np.zeros((4, 4, 3), np.uint8))
    monkeypatch.setitem(__import__("sys").modules, "PIL", None)
    r = cli("calibrate", tmp_path / "cnn.pt", "--trust-pickle", "--data", tmp_path / "imgs")
    assert_clean_error(r, "Pillow", "quantcli[images]")
    monkeypatch.setitem(__import__("sys").modules, "transformers", None)
    assert_clean_error(cli("calibrate", d / "clf", "--data", d / "texts.txt"), "transformers", "quantcli[hf]")
    _no_output(tmp_path)


def test_one_channel_model_takes_mean_alone(tmp_path):
    """--mean without --std on a 1-channel model: the std stays the luma default (it was refused as "--std has
    3 values", though --std was not given)."""
    from quantcli.inputs.image_data import IMAGENET_STD_L

    torch.manual_seed(0)
    cnn = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3, padding=1), torch.nn.Flatten(), torch.nn.Linear(64, 2))
    torch.save(cnn.eval(), tmp_path / "grey.pt")
    _png(tmp_path / "imgs" / "g.png", np.full((8, 8), 51, np.uint8))
    out = tmp_path / "grey.calib.pt"
    r = cli(
        "calibrate", tmp_path / "grey.pt", "--trust-pickle", "--data", tmp_path / "imgs", "--image-size", "4",
        "--mean", "0.5", "--out", out,
    )  # fmt: skip
    assert r.exit_code == 0, r.output
    x = torch.load(out, weights_only=True)["inputs"]["example"]["input"]
    want = (51 / 255 - 0.5) / IMAGENET_STD_L[0]
    assert x.shape == (1, 1, 4, 4) and torch.allclose(x, torch.full_like(x, want), atol=1e-6)


def test_a_projection_head_exports_its_embeddings(tmp_path):
    """CLIPTextModelWithProjection exists for its text_embeds: quantcli returned last_hidden_state (no
    ``*logits``), the graph had that alone and its text_projection was pruned as unused. A task head without
    logits now returns its ``*_embeds``, and the graph's output is them, as the model computes them."""
    cfg = transformers.CLIPTextConfig(
        **TINY_ENCODER, max_position_embeddings=16, projection_dim=8, eos_token_id=3
    )
    torch.manual_seed(0)
    folder = tmp_path / "clip"
    model = transformers.CLIPTextModelWithProjection(cfg).eval()
    save_folder(model, folder)
    rng = np.random.default_rng(0)
    ids = rng.integers(5, len(WORDS), (16, 6))
    ids[:, -1] = 3  # the EOS token CLIP pools at
    np.savez(tmp_path / "d.npz", input_ids=ids, attention_mask=np.ones_like(ids))
    ck, graph = tmp_path / "clip.calib.pt", tmp_path / "clip.onnx"
    r = cli("calibrate", folder, "--data", tmp_path / "d.npz", "--placement", "all", "--out", ck, "--json")
    assert r.exit_code == 0, r.output
    assert "text_projection" in json.loads(r.stdout)["layers"]["quantized"]
    assert cli("export", ck, "--onnx", graph).exit_code == 0
    import onnxruntime as ort

    sess = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    assert [o.name for o in sess.get_outputs()] == ["text_embeds"]
    got = sess.run(None, {"input_ids": ids, "attention_mask": np.ones_like(ids)})[0]
    with torch.no_grad():
        want = model(input_ids=torch.from_numpy(ids)).text_embeds.numpy()
    cos = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
    assert got.shape == want.shape and cos.min() > 0.99
    r = cli("verify", graph, "--reference", ck, "--data", tmp_path / "d.npz")
    assert r.exit_code == 0, r.output


def test_a_multiple_choice_model_with_text_data_says_what_it_takes(bert, tmp_path):
    """BertForMultipleChoice reads (batch, choices, sequence) token ids; a text file failed inside the model
    with "shape '[-1, 40]' is invalid for input of size 8", which said nothing of what to give."""
    _, d = bert
    cfg = transformers.BertConfig(**TINY_ENCODER, max_position_embeddings=64)
    torch.manual_seed(0)
    save_folder(transformers.BertForMultipleChoice(cfg), tmp_path / "mc", True)
    out = tmp_path / "mc.calib.pt"
    r = cli("calibrate", tmp_path / "mc", "--data", d / "texts.txt", "--out", out)
    assert_clean_error(r, "BertForMultipleChoice takes (batch, choices, sequence) token ids", ".npz")
    assert not out.exists()
