// stb_image as llama.cpp's mtmd compiles and calls it (tools/mtmd/mtmd-helper.cpp: STB_IMAGE_IMPLEMENTATION
// in a C++ file of a Release build, x86-64 so STBI_SSE2 is on; stbi_load_from_memory(buf, len, &nx, &ny, &nc,
// 3)). For each JPEG named on the command line: writes FILE's RGB bytes to OUT_DIR/NAME.rgb and prints
// "NAME WIDTH HEIGHT" (NAME: the file name without ".jpg"), or "NAME refused" when stb refuses it.
//   g++ -O3 -DNDEBUG -std=c++17 -I$LLAMA/vendor jpeg_stb.cpp -o jpeg_stb
//   ./jpeg_stb OUT_DIR a.jpg b.jpg ...
#define STB_IMAGE_IMPLEMENTATION
#include "stb/stb_image.h"

#include <cstdio>
#include <string>
#include <vector>

int main(int argc, char ** argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: %s OUT_DIR FILE.jpg...\n", argv[0]);
        return 2;
    }
#if !defined(STBI_SSE2)
    fprintf(stderr, "STBI_SSE2 is off: not the build mtmd runs on x86-64\n");
    return 1;
#endif
    std::string out_dir = argv[1];
    for (int i = 2; i < argc; ++i) {
        std::string path = argv[i];
        FILE * f = fopen(path.c_str(), "rb");
        if (!f) { perror(path.c_str()); return 1; }
        std::vector<unsigned char> buf;
        unsigned char chunk[65536];
        size_t n;
        while ((n = fread(chunk, 1, sizeof chunk, f)) > 0) buf.insert(buf.end(), chunk, chunk + n);
        fclose(f);
        std::string name = path.substr(path.find_last_of('/') + 1);
        name = name.substr(0, name.size() - 4);
        int nx, ny, nc;
        unsigned char * data = stbi_load_from_memory(buf.data(), (int) buf.size(), &nx, &ny, &nc, 3);
        if (!data) {
            printf("%s refused\n", name.c_str());
            continue;
        }
        std::string out = out_dir + "/" + name + ".rgb";
        FILE * o = fopen(out.c_str(), "wb");
        if (!o) { perror(out.c_str()); return 1; }
        fwrite(data, 1, (size_t) nx * ny * 3, o);
        fclose(o);
        stbi_image_free(data);
        printf("%s %d %d\n", name.c_str(), nx, ny);
    }
    return 0;
}
