

@pytest.mark.mpi(min_size=4)
def test_pipeline_layers_wrappers_are_checked_in_a_sequence_region(world):
    """Regression (found by the ViT port): the layers ``pipeline_layers()`` makes that are not the model's modules
    (the ViT's ``PatchEmbed``, which concatenates the class token; its ``Head``, which takes the class token's row)
    run in the sequence region of each stage, but were not checked: the refusal was about positions (``arange``),
    which the ViT does not number.  Now each is named by ``pipeline_layers()[i]`` and its class."""
    if world.world_size != 4:
        pytest.skip("pp2 x tp2 at 4 ranks")
    grid = axonmpi.ProcessGrid(world, G_inter=2, G_intra_c=2)
    try:
        axonmpi.manual_seed(1)
        opts = LAYOUTS["pp2_megatron2_sp_1f1b"][2]("vit")
        with pytest.raises(ValueError, match=r"'pipeline_layers\(\)\[0\]' \(ported_vit_axonmpi\.PatchEmbed\), "
                                             r"'pipeline_layers\(\)\[3\]' \(ported_vit_axonmpi\.Head\)"):
            parallelize(pc.build("vit"), grid=grid, **opts)
    finally:
        grid.free()
