"""The kernel-class rule table: defaults on real kernel names, conditions, user rules."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from specpilot.errors import InputError
from specpilot.probes.classify import Classifier, load_rules
from specpilot.probes.traces.model import Aggregate, KernelGroup, StepInfo


def _cls(name, kind="kernel", tag=None, dims=None, stream=7, vocab=None, table=None, per_step_agg=None):
    clf = Classifier(table or load_rules(), vocab=vocab)
    if per_step_agg is not None:
        clf.fit(per_step_agg)
    return clf.classify(KernelGroup(step=0, name=name, kind=kind, stream=stream, tag=tag, dims=dims, count=1))


@pytest.mark.parametrize("name,want", [
    ("nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT", "linear"),
    ("Cijk_Alik_Bljk_BBS_BH_Bias_HA_S_SAV_UserArgs_MT64x32x256_MI16x16x1_SN_LDSB1", "linear"),
    ("void cutlass::Kernel2<cutlass_80_tensorop_bf16_s16816gemm_relu_bf16_64x64_64x4_tn_align8>(T1::Params)", "linear"),
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize64x64x64_warpgroupsize1x1x1", "linear"),
    ("void cublasLt::splitKreduce_kernel<(int)32, (int)16, int, float>", "linear"),
    ("void paged_attention_ll4mi_QKV_mfma16_kernel<0, __hip_bfloat16>", "attention"),
    ("void flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128>>", "attention"),
    ("cudnn_generated_fort_native_sdpa_sm80_flash_fprop_wmma_f16_knob_35", "attention"),
    ("BatchDecodeWithPagedKVCacheKernel", "attention"),
    ("void (anonymous namespace)::store_kvcache<2048l, 4, false, long>", "attention"),
    ("chunk_gated_delta_rule_fwd_kernel_h_blockdim64", "gdn"),
    ("_causal_conv1d_update_kernel", "gdn"),
    ("fused_moe_kernel", "moe"),
    ("void flashinfer::norm::FusedAddRMSNormKernel<8u, __nv_bfloat16>(X)", "norm"),
    ("void flashinfer::sampling::TopKTopPSamplingFromProbKernel<1024u>(X)", "sampling"),
    ("ncclDevKernel_AllReduce_Sum_bf16_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("cross_device_reduce_1stage<__nv_bfloat16, 8>", "communication"),
    ("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi64ELi8ELb0ELb0ELb1ELi1EEEvPT0_PT_PfS4_S4_S4_diiiiiiib", "norm"),
    ("void rotary_embedding_kernel<c10::BFloat16, true>", "norm"),
    ("triton_red_fused_add_mean_mul_pow_rsqrt_0", "norm"),
    ("_ZN7sgl_hip10activation18act_and_mul_kernelI14__hip_bfloat16", "norm"),
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>", "sampling"),
    ("top_k_top_p_sampling_from_probs_kernel", "sampling"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>", "elementwise"),
    ("triton_poi_fused_add_0", "elementwise"),
    # inductor names list every op fused in, including the custom GEMM or attention op they feed
    ("triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_w12_matmul_6", "norm"),
    ("triton_poi_fused_mul_silu_split_with_sizes_w12_matmul_7", "elementwise"),
    ("triton_poi_fused__to_copy_add_cat_mul_neg_slice_split_with_sizes_store_kv_attention_unsqueeze_view_1",
     "elementwise"),
    ("_store_kv", "attention"),
    ("_attn_split", "attention"),
    ("_matmul_ogs_NNT_bf16xbf16xmxfp4_16x128x256x1_swiglu", "moe"),
    ("_finalize_matmul_scatter_bf16", "moe"),
    ("bmm_Bfloat16_MxE2m1MxE4m3_Fp32_t128x16x256u2_s3_et128x16_m128x16x32_cga1x1x1_tmaOpt_clmp_dynBatch_sm100f", "moe"),
    ("_combined_routing_compute", "moe_routing"),
    ("_sum_bitmatrix_rows", "moe_routing"),
    ("_topk_forward", "moe_routing"),
    ("void moe::dev::routing::routingIndicesHistogramKernel<moe::dev::routing::routingRenormalize::KernelParams<>>(P)",
     "moe_routing"),
    ("void vllm::moe::topkGatingSoftmax<4, 128, 4, 16, 32, int, float>(float const*)", "moe_routing"),
    ("void vllm::moe::moe_align_block_size_kernel<int>(int const*)", "moe_routing"),
    ("some_custom_kernel_nobody_knows", "other"),
])
def test_default_rules_on_real_names(name, want):
    assert _cls(name).cls == want


def test_kinds_and_ranges():
    assert _cls("Memcpy DtoH (Device -> Host)", kind="memcpy").cls == "memcpy"
    assert _cls("Memset", kind="memset").cls == "memcpy"
    assert _cls("CUDA graph exec 2 (whole graph)", kind="graph").cls == "other"
    # ranges beat names: a GEMM launched by the drafter is drafter time, the drafter's LM head too
    assert _cls("nvjet_sm90_tst_64x8", tag="draft").cls == "drafter"
    assert _cls("nvjet_sm90_tst_256x8", tag="draft/lm_head").cls == "drafter"
    assert _cls("nvjet_sm90_tst_256x8", tag="lm_head").cls == "lm_head"
    assert _cls("nvjet_sm90_tst_256x8", tag="not_a_head").cls == "linear"


def test_dims_vocab_needs_the_model():
    name, dims = "Cijk_Alik_Bljk_MT256x48x64", "aten::mm[[32,4096],[4096,151936]]"
    assert _cls(name, dims=dims, vocab=151936).cls == "lm_head"
    assert _cls(name, dims=dims, vocab=None).cls == "linear"
    assert _cls(name, dims="aten::mm[[32,4096],[4096,12288]]", vocab=151936).cls == "linear"


def test_per_step_rule_is_a_user_condition_not_the_lm_head_default(tmp_path):
    steps = [StepInfo(index=i, label=str(i), start=0, end=1) for i in range(3)]
    groups = []
    for i in range(3):
        groups += [KernelGroup(i, "Cijk_layer", count=36), KernelGroup(i, "Cijk_head", count=1)]
    agg = Aggregate("x", "kineto", "1", None, "range", "", steps, groups)
    # running once per step does not make a GEMM the LM head (an fp32 RoPE GEMM runs once too)
    assert _cls("Cijk_head", per_step_agg=agg).cls == "linear"
    f = tmp_path / "once.yaml"
    f.write_text("schema: specpilot.kernel_classes/1\nrules:\n  - {class: lm_head, match: '^Cijk_', per_step: 1}\n")
    t = load_rules([str(f)])
    assert _cls("Cijk_head", per_step_agg=agg, table=t).cls == "lm_head"
    assert _cls("Cijk_layer", per_step_agg=agg, table=t).cls == "linear"


@pytest.mark.parametrize("name,base", [
    ("void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>(X)",
     "at::native::reduce_kernel"),
    ("std::enable_if<(((8)>(0)))&&vllm::_typeConvert<c10::BFloat16>::exists, void>::type "
     "vllm::fused_add_rms_norm_kernel<c10::BFloat16, 8>(c10::BFloat16*, long)", "vllm::fused_add_rms_norm_kernel"),
    ("void (anonymous namespace)::store_kvcache<2048l, 4, false, long>((anonymous namespace)::StoreKVCacheParams)",
     "store_kvcache"),
    ("_ZN5aiter24add_rmsnorm_quant_kernelIDF16bDF16bLi64ELi8ELb0ELb0ELb1ELi1EEEvPT0_PT_PfS4_S4_S4_diiiiiiib",
     "aiter::add_rmsnorm_quant_kernel"),
    ("_ZN7ck_tile6kentryILi1ENS_12Rmsnorm2dFwdINS_27Rmsnorm2dFwdPipelineOnePassINS", "ck_tile::Rmsnorm2dFwd"),
    ("void cutlass::Kernel2<cutlass_80_simt_sgemm_128x32_8x5_nn_align1>(cutlass_80_simt_sgemm_128x32_8x5_nn_align1::Params)",
     "cutlass_80_simt_sgemm_128x32_8x5_nn_align1"),
    ("void cutlass::device_kernel<flash::FlashAttnFwdSm90<flash::CollectiveMainloopFwdSm90<2>, int>>(P)",
     "flash::FlashAttnFwdSm90"),
    ("nvjet_tst_64x64_64x16_2x1_2cta_v_bz_bias_TNT", "nvjet_tst_64x64_64x16_2x1_2cta_v_bz_bias_TNT"),
])
def test_base_names(name, base):
    from specpilot.probes.kernel_names import base_name

    assert base_name(name) == base


def test_template_arguments_never_decide_the_class():
    # names the whole-signature rules got wrong (issue 35)
    assert _cls("void tensorrt_llm::kernels::quantize_with_block_size<(tensorrt_llm::BlockScaleQuantizationType)2, "
                "__nv_bfloat16, 32, true, flashinfer::QuantizationSFLayout>(int)").cls == "elementwise"
    assert _cls("void moe::dev::finalize::finalizeKernelVecLoad<moe::dev::finalize::KernelParams<cutlass::bfloat16_t, "
                "cutlass::bfloat16_t, 4, true> >(P)").cls == "moe"
    assert _cls("void at::native::(anonymous namespace)::upsample_nearest2d_out_frame<c10::BFloat16>(X)").cls == "elementwise"
    assert _cls("void cudnn::fusion::lean_reduction_kernel<false, false, false>(void*)").cls == "attention"
    assert _cls("reduce_segments").cls == "attention"


def test_args_and_op_conditions():
    mean = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float>>>(X)"
    assert _cls(mean).cls == "norm"  # eager RMSNorm's mean
    assert _cls(mean, dims="aten::mean[[1,7,896]]").cls == "norm"
    assert _cls(mean, dims="aten::avg_pool2d[[1,3,224,224]]").cls == "elementwise"  # a mean, not a norm
    argmax = "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>>>(X)"
    assert _cls(argmax).cls == "sampling"


def test_norm_module_ranges_take_the_eager_rmsnorm_kernels():
    mul = "void at::native::vectorized_elementwise_kernel<4, at::native::BinaryFunctor<float, float, float, MulFunctor<float>>>(X)"
    assert _cls(mul).cls == "elementwise"
    assert _cls(mul, tag="nn.Module: Qwen2DecoderLayer_0/nn.Module: Qwen2RMSNorm_0").cls == "norm"
    assert _cls(mul, tag="nn.Module: Qwen2RMSNorm_0/nn.Module: Linear_3").cls == "elementwise"


def test_position_rule_takes_the_last_gemm_only():
    name = "nvjet_sm90_tst_256x8_64x6_2x1_v_bz_TNT"
    g = KernelGroup(step=0, name=name, position="last")
    clf = Classifier(load_rules())
    assert clf.classify(g).cls == "lm_head"
    assert clf.classify(KernelGroup(step=0, name=name)).cls == "linear"
    rule = next(r for r in clf.table.rules if r.position == "last")
    assert clf.position_candidate(rule, KernelGroup(step=0, name=name))
    assert not clf.position_candidate(rule, KernelGroup(step=0, name="fused_moe_kernel"))  # claimed by moe first
    assert not clf.position_candidate(rule, KernelGroup(step=0, name=name, tag="draft"))


def test_user_rules_go_first_and_can_replace(tmp_path):
    f = tmp_path / "mine.yaml"
    f.write_text("schema: specpilot.kernel_classes/1\nrules:\n"
                 "  - {class: norm, match: 'reduce_kernel<.*MeanOps'}\n"
                 "  - {class: drafter, stream: 13}\n"
                 "  - {class: w12, match: 'w12_gemv'}\n")
    t = load_rules([str(f)])
    assert t.sources == ["mine.yaml", "default"] and "w12" in t.classes
    assert _cls("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps<float>>>", table=t).cls == "norm"
    assert _cls("nvjet_sm90", stream=13, table=t).cls == "drafter"
    d = _cls("w12_gemv_kernel", table=t)
    assert d.cls == "w12" and d.rule.source == "mine.yaml" and "mine.yaml#2" in d.rule.describe()
    r = tmp_path / "only.yaml"
    r.write_text("schema: specpilot.kernel_classes/1\nreplace: true\nrules:\n  - {class: everything, match: '.'}\n")
    t2 = load_rules([str(r)])
    assert _cls("nvjet", table=t2).cls == "everything" and len(t2.rules) == 1


@pytest.mark.parametrize("text,msg", [
    ("rules: []", "unknown schema"),
    ("schema: specpilot.kernel_classes/1\nrules: []", "non-empty list"),
    ("schema: specpilot.kernel_classes/1\nrules: [{match: x}]", "needs a 'class'"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a}]", "no condition"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, match: '('}]", "not a valid regex"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, colour: red}]", "unknown key"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, kind: gpu}]", "kind must be"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, dims: big}]", "dims must be"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, per_step: -1}]", "per_step must be"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, match: x, position: first}]", "position must be"),
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, kind: kernel, position: last}]", "needs match"),
    ("schema: [unclosed", "not valid YAML"),
    # the second one won: a rule that matched nothing it was written for
    ("schema: specpilot.kernel_classes/1\nrules: [{class: a, match: x, match: y}]",
     r"bad.yaml:2: not valid YAML \(key 'match' given twice \(lines 2 and 2\)\)"),
])
def test_bad_rule_files(tmp_path, text, msg):
    f = tmp_path / "bad.yaml"
    f.write_text(text)
    with pytest.raises(InputError, match=msg):
        load_rules([str(f)])


# every kernel the package launches, with the class `profile` gives it (a new kernel needs its class
# here, and a rule in probes/kernel_classes.yaml where the generic rules miss it)
ENGINE_KERNELS = {
    **dict.fromkeys(["_gemv_kernel", "_ring_kernel", "_skinny_kernel", "_warpk_kernel", "_restore_kernel",
                     "_escape_kernel", "_w12_gemv_kernel", "_w12_gemv_gl_kernel", "_w12_fused_gl_kernel",
                     "_w12_gemm_kernel", "_w12_mma_kernel", "_w12_mma_tma_kernel", "_w12_warpk_kernel"], "linear"),
    **dict.fromkeys(["_lm_head_prep", "_lm_head_bounds", "_lm_head_select", "_lm_head_fallback",
                     "_lm_head_finish"], "lm_head"),
    **dict.fromkeys(["_attn_split", "_attn_merge", "_inv_split", "_inv_merge", "_store_kv"], "attention"),
    **dict.fromkeys(["_gdn_rows_kernel", "_conv_rows_kernel", "_decay_kernel", "_wy_kernel"], "gdn"),
    **dict.fromkeys(["_rms_norm_kernel", "_rms_norm_rows_kernel", "_add_rms_norm_rows_kernel", "_gated_norm_kernel",
                     "_rope_store_rows_kernel", "_qk_norm_rope_kernel", "_silu_mul_rows_kernel",
                     "_sigmoid_gate_kernel"], "norm"),
    **dict.fromkeys(["_argmax_chunks", "_argmax_merge", "_frontier_kernel", "_budget_rank_kernel"], "sampling"),
    **dict.fromkeys(["_quantize_rows_kernel", "_dequant_split_kernel"], "elementwise"),
}


def test_every_kernel_the_engine_launches_has_its_class():
    """`profile` on a trace of the embedded engine puts each of its kernels in its class (the ring
    GEMM was "other", the GDN conv "linear")."""
    import specpilot.engine
    import specpilot.kernels

    launched = set()
    for pkg in (specpilot.kernels, specpilot.engine):
        for f in Path(pkg.__file__).parent.rglob("*.py"):
            launched |= set(re.findall(r"\b(_[A-Za-z0-9_]+)\[[^\]\n]*\]\(", f.read_text()))
    assert launched == set(ENGINE_KERNELS)
    got = {n: _cls(n).cls for n in ENGINE_KERNELS}
    assert got == ENGINE_KERNELS


def test_a_split_k_reduce_is_not_taken_for_the_lm_head(fixtures_dir, run_cli):
    """One split-K linear per step (its GEMM, then cuBLAS's reduce) and a softmax: no LM head."""
    import json

    code, out, err = run_cli("profile", fixtures_dir / "nsys_h200_linear_softmax_schema3.20.sqlite", "--format", "json")
    assert code == 0, err
    classes = json.loads(out)["classes"]
    assert "lm_head" not in classes and classes["linear"]["calls"] == 2
