/* gen_imagefolder OUT CLASSES TRAIN_PER_CLASS VAL_PER_CLASS — an
 * ImageNet-layout folder of JPEGs for the trainer's tests:
 * OUT/{train,val}/nNNNNNNN/img_K.JPEG, each image of its own size (96 to
 * 320 pixels a side, so crops and resizes really work) with a class-tinted
 * pattern. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <turbojpeg.h>

static int mk(const char *p)
{
    if (mkdir(p, 0755) == 0 || errno == EEXIST) return 0;
    perror(p);
    return 1;
}

int main(int argc, char **argv)
{
    if (argc != 5) {
        fprintf(stderr, "usage: gen_imagefolder OUT CLASSES TRAIN_PER_CLASS VAL_PER_CLASS\n");
        return 2;
    }
    const char *out = argv[1];
    int classes = atoi(argv[2]), per[2] = {atoi(argv[3]), atoi(argv[4])};
    const char *split[2] = {"train", "val"};
    tjhandle tj = tjInitCompress();
    unsigned char *rgb = malloc(320 * 320 * 3);
    if (!tj || !rgb || mk(out)) return 1;
    unsigned x = 2463534242u;
    for (int s = 0; s < 2; s++) {
        char d[4096];
        snprintf(d, sizeof d, "%s/%s", out, split[s]);
        if (mk(d)) return 1;
        for (int c = 0; c < classes; c++) {
            snprintf(d, sizeof d, "%s/%s/n%08d", out, split[s], c + 1);
            if (mk(d)) return 1;
            for (int k = 0; k < per[s]; k++) {
                x ^= x << 13, x ^= x >> 17, x ^= x << 5;
                int w = 96 + (int)(x % 225), h = 96 + (int)((x >> 10) % 225);
                for (int i = 0; i < h; i++)
                    for (int j = 0; j < w; j++) {
                        unsigned char *p = rgb + (i * w + j) * 3;
                        p[0] = (unsigned char)(40 * c + i);
                        p[1] = (unsigned char)(j + 3 * k);
                        p[2] = (unsigned char)((i ^ j) + 60 * c);
                    }
                unsigned char *jpg = NULL;
                unsigned long len = 0;
                if (tjCompress2(tj, rgb, w, 0, h, TJPF_RGB, &jpg, &len, TJSAMP_420, 85, 0) != 0) {
                    fprintf(stderr, "tjCompress2: %s\n", tjGetErrorStr2(tj));
                    return 1;
                }
                char f[4200];
                snprintf(f, sizeof f, "%s/img_%d.JPEG", d, k);
                FILE *fp = fopen(f, "wb");
                if (!fp || fwrite(jpg, 1, len, fp) != len || fclose(fp) != 0) {
                    perror(f);
                    return 1;
                }
                tjFree(jpg);
            }
        }
    }
    tjDestroy(tj);
    free(rgb);
    return 0;
}
