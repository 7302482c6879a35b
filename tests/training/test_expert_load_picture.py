"""The MoE console / metrics numbers and the layers x experts load picture (``<dump_folder>/expert_load.svg``)."""

import xml.etree.ElementTree as ET

import torch

from titanlike.training.metrics import expert_metrics, write_expert_load_picture

SVG = "{http://www.w3.org/2000/svg}"


def test_expert_metrics_per_layer_and_dropless():
    loads = torch.tensor([[4, 4, 4, 4], [8, 0, 4, 4]])
    m = expert_metrics({"loads": loads, "aux_loss": torch.tensor([0.25, 0.5], dtype=torch.float64)})
    assert m["moe_aux_loss"] == 0.75 and m["moe_load_max_over_mean"] == 2.0
    assert (m["moe_load_max_over_mean/0"], m["moe_load_max_over_mean/1"]) == (1.0, 2.0)
    assert m["moe_dropped_tokens"] == 0.0


def test_load_picture_has_a_cell_per_layer_and_expert_coloured_by_load(tmp_path):
    loads = torch.tensor([[4, 4, 4, 4], [8, 0, 4, 4], [1, 2, 3, 6]])
    path = write_expert_load_picture(tmp_path, loads, step=7)
    assert path == tmp_path / "expert_load.svg" and not list(tmp_path.glob("*.tmp"))
    root = ET.parse(path).getroot()
    cells = list(root.iter(f"{SVG}rect"))
    assert len(cells) == 3 * 4
    fill = {c.find(f"{SVG}title").text.split(":")[0]: c.get("fill") for c in cells}
    assert fill["layer 0 expert 0"] == "rgb(0,102,255)"  # the mean: blue
    assert fill["layer 1 expert 1"] == "rgb(255,255,255)"  # no tokens: white
    assert fill["layer 1 expert 0"] == "rgb(255,0,0)"  # twice the mean: red
    assert "8 tokens" in cells[4].find(f"{SVG}title").text
    text = " ".join(t.text for t in root.iter(f"{SVG}text"))
    assert "step 7" in text and "3 layers x 4 experts" in text and "worst max/mean 2.00" in text
    write_expert_load_picture(tmp_path, loads[:1], step=8)  # rewritten whole
    assert len(list(ET.parse(path).getroot().iter(f"{SVG}rect"))) == 4
