/* The instruction sets this build targets, spelled as /proc/cpuinfo spells them, so the loader
   can tell a kernel the CPU cannot run (absent by design) from one the compiler failed to build
   although the CPU has its instructions (an old compiler). Linked into every kernel library. */
const char* stagewise_isa(void) {
    return ""
#ifdef __AVX2__
        " avx2"
#endif
#ifdef __FMA__
        " fma"
#endif
#ifdef __F16C__
        " f16c"
#endif
#ifdef __AVX512F__
        " avx512f"
#endif
#ifdef __AVX512BW__
        " avx512bw"
#endif
#ifdef __AVX512VL__
        " avx512vl"
#endif
#ifdef __AVX512VNNI__
        " avx512_vnni"
#endif
#ifdef __AVX512BF16__
        " avx512_bf16"
#endif
#ifdef __AVXVNNI__
        " avx_vnni"
#endif
        ;
}
