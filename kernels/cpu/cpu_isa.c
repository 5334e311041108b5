/*
 * cpu_isa.c — what the CPU offers for low-precision math, asked once.
 *
 * oneDNN decides the ISA its kernels use (dnnl_get_effective_cpu_isa,
 * which honours ONEDNN_MAX_CPU_ISA, so a test can ask for the AVX2 path
 * on an AVX-512 machine); kpl registers bf16 convolution and matmul
 * kernels only where that ISA computes bf16 natively (AVX512-BF16, AMX).
 * f16 has no native CPU kernel here (oneDNN 2.6 offers f16 only with
 * AVX512-FP16, which kpl's target CPUs lack), so it is computed in f32.
 */
#include "kernels_impl.h"

#include <dnnl.h>
#include <stdio.h>
#include <string.h>

static bool isa_has(dnnl_cpu_isa_t have, dnnl_cpu_isa_t want)
{
    return ((unsigned)have & (unsigned)want) == (unsigned)want;
}

bool kpl__cpu_bf16_native(void)
{
    return isa_has(dnnl_get_effective_cpu_isa(), dnnl_cpu_isa_avx512_core_bf16);
}

bool kpl__cpu_avx512(void)
{
    return isa_has(dnnl_get_effective_cpu_isa(), dnnl_cpu_isa_avx512_core);
}

bool kpl__cpu_amx(void)
{
    return isa_has(dnnl_get_effective_cpu_isa(), dnnl_cpu_isa_avx512_core_amx);
}

static const char *isa_name(dnnl_cpu_isa_t isa)
{
    static const struct {
        dnnl_cpu_isa_t isa;
        const char *name;
    } names[] = {
        {dnnl_cpu_isa_avx512_core_amx, "avx512_core_amx"},
        {dnnl_cpu_isa_avx512_core_bf16, "avx512_core_bf16"},
        {dnnl_cpu_isa_avx512_core_vnni, "avx512_core_vnni"},
        {dnnl_cpu_isa_avx512_core, "avx512_core"},
        {dnnl_cpu_isa_avx2_vnni, "avx2_vnni"},
        {dnnl_cpu_isa_avx2, "avx2"},
        {dnnl_cpu_isa_avx, "avx"},
        {dnnl_cpu_isa_sse41, "sse41"},
    };
    for (size_t i = 0; i < sizeof names / sizeof *names; i++)
        if (isa_has(isa, names[i].isa)) return names[i].name;
    return "none";
}

/* The model name and the math flags of /proc/cpuinfo's first CPU. */
static void cpuinfo(char *model, size_t mlen, char *flags, size_t flen)
{
    static const char *const wanted[] = {"avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16",
                                         "avx512_fp16", "amx_bf16", "amx_tile"};
    snprintf(model, mlen, "unknown CPU");
    flags[0] = 0;
    FILE *f = fopen("/proc/cpuinfo", "r");
    if (!f) return;
    char line[8192];
    bool got_model = false, got_flags = false;
    while ((!got_model || !got_flags) && fgets(line, sizeof line, f)) {
        char *v = strchr(line, ':');
        if (!v) continue;
        v += 1 + (v[1] == ' ');
        v[strcspn(v, "\n")] = 0;
        if (!got_model && !strncmp(line, "model name", 10)) {
            snprintf(model, mlen, "%s", v);
            got_model = true;
        } else if (!got_flags && !strncmp(line, "flags", 5)) {
            size_t n = 0;
            for (size_t i = 0; i < sizeof wanted / sizeof *wanted; i++) {
                size_t w = strlen(wanted[i]);
                bool found = false;
                for (char *p = v; !found && (p = strstr(p, wanted[i])); p += w)
                    found = (p == v || p[-1] == ' ') && (p[w] == ' ' || p[w] == 0);
                if (found && n + w + 2 < flen)
                    n += (size_t)snprintf(flags + n, flen - n, "%s%s", n ? " " : "", wanted[i]);
            }
            got_flags = true;
        }
    }
    fclose(f);
}

static char info_line[512];

static void info_fill(void)
{
    char model[128], flags[160];
    cpuinfo(model, sizeof model, flags, sizeof flags);
    snprintf(info_line, sizeof info_line, "%s; %s; oneDNN %s; bf16 %s, f16 emulated", model,
             flags[0] ? flags : "no AVX2", isa_name(dnnl_get_effective_cpu_isa()),
             kpl__cpu_bf16_native() ? "native" : "emulated");
}

const char *kpl_cpu_math_info(void)
{
    static pthread_once_t once = PTHREAD_ONCE_INIT;
    pthread_once(&once, info_fill);
    return info_line;
}
