# Every dependency comes from Debian's packages (scripts/install-deps.sh installs them).
# gRPC must be found once, here at top-level scope: a second find_package(gRPC) in another scope
# fails on its c-ares target.
find_package(Threads REQUIRED)
find_package(OpenMP REQUIRED COMPONENTS CXX)
find_package(absl CONFIG REQUIRED)
find_package(nlohmann_json CONFIG REQUIRED)
find_package(GTest CONFIG REQUIRED)
find_package(benchmark CONFIG REQUIRED)
find_package(Protobuf REQUIRED)  # module mode: Debian ships no CONFIG package for protobuf
find_package(gRPC CONFIG REQUIRED)
find_package(prometheus-cpp CONFIG REQUIRED)
find_package(Gloo CONFIG REQUIRED)
