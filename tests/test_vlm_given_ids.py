"""Given answer ids end at their first end token, as a captioner's captions do (explain_caption's docstring).

Passing a generated explanation's ``e.ids`` back (to explain the same answers with another method) explained the end
token and generate's padding after it as words ('</s>', '<pad>', with maps) for every answer shorter than the longest.
"""

import pytest
import torch

import vitexplain as vx


@pytest.fixture(scope="module")
def explainer():
    return vx.Explainer(vx.zoo.load("shapes-vlm").eval())


def _images():
    one = vx.data.shapes(1, seed=7, num_objects=1).images  # a short answer ("green square"), then the end token
    two = vx.data.shapes(1, seed=8, num_objects=2).images  # a longer one
    return [one[0], two[0]]


def test_the_ids_of_a_generated_explanation_explain_the_same_words(explainer):
    images = _images()
    generated = explainer.explain_caption(images, prompt="describe the image")
    lengths = [len(t) for t in generated.tokens]
    assert lengths[0] < lengths[1]  # (the case: the first answer ends early, padded after its end token)
    end = explainer.adapter.end_ids[0]
    assert int(generated.ids[0, lengths[0]]) == end
    again = explainer.explain_caption(images, prompt="describe the image", caption=generated.ids)
    assert again.tokens == generated.tokens
    for b in range(2):
        n = lengths[b]
        torch.testing.assert_close(again.token_scores[b][:n], generated.token_scores[b][:n], atol=1e-6, rtol=1e-5)
        assert not bool(again.token_scores[b][n:].any())  # no map for the end token or the padding
    torch.testing.assert_close(again.maps, generated.maps, atol=1e-6, rtol=1e-5)


def test_an_answer_that_starts_with_the_end_token_is_refused(explainer):
    end = explainer.adapter.end_ids[0]
    with pytest.raises(vx.UsageError, match="starts with the end token"):
        explainer.explain_caption(_images(), prompt="describe the image", caption=[[end, 5], [6, 10]])
